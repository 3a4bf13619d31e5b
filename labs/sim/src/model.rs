//! The simulated model: an OpenAI-compatible `/v1/chat/completions` that
//! plays a research agent, with fault injection, plus `GET /stats`.
//!
//! # Behaviour
//! Deterministic for a given `--seed` and request body (faults chosen by rate
//! also depend on the request's sequence number, so a retry can succeed).
//! With `tools` offered it plans like an agent: no tool result since the last
//! user message → a `search` call (`{"q": ...}` from the prompt, the SearxNG parameter); after a
//! `search` result → a `fetch` call whose `url` is the first `url` in the
//! result JSON (fallback `http://<Host>/page/<slug>`); after a `fetch` result
//! → the section: a few paragraphs of Markdown citing the fetched URL (the
//! same plan runs through the text tool protocol, below). With
//! `response_format` `json_schema` it returns an instance of the schema
//! (required properties, arrays of `minItems` (3 if unset, bounded by
//! `maxItems`), strings, numbers, integers, booleans, enums); `json_object`
//! gets a small object. Streaming follows OpenAI's chunk format: a role
//! chunk, content or tool-call fragments, a chunk with `finish_reason`, a
//! usage chunk when `stream_options.include_usage` is set, then
//! `data: [DONE]`.
//!
//! `GET /v1/models` lists the one model, `sim-1`. `GET /stats` counts chat
//! requests, streaming ones, faults by kind, tool calls proposed (by name),
//! `response_formats` (`json_schema`, `json_object`, `json_object_schema`
//! for a `json_object` with a `schema`, `none`), `tools_offered` (requests
//! with native `tools`), `text_tool_calls` (calls made through the text
//! protocol) and the `provider`.
//!
//! # Providers
//! `--provider` (env `LH_SIM_PROVIDER`) picks the server the sim answers as;
//! `--context-chars N` (env `LH_SIM_CONTEXT_CHARS`, 0 = no limit) is a context
//! window in characters of the messages' JSON (tokens are characters / 4).
//! - `openai` (default): as above; errors
//!   `{"error":{"message","type","param":null,"code"}}`, a bad request is 400
//!   (`invalid_json`, `missing_messages`), context overflow 400
//!   `context_length_exceeded`; unknown paths 404 `Invalid URL (METHOD PATH)`.
//! - `llama-cpp` (llama-cpp-python's server): `response_format` `json_schema`
//!   is refused with HTTP 500 `{"error":{"message":"[{'type':
//!   'literal_error', 'loc': ('body', 'response_format', 'type'), 'msg':
//!   "Input should be 'text' or 'json_object'", 'input':
//!   'json_schema'}]","type":"internal_server_error","param":null,"code":null}}`;
//!   `{"type":"json_object","schema":{...}}` gets an instance of the schema;
//!   `tools` are ignored (it answers in prose); a bad request is a 500 of the
//!   same validation shape (`json_invalid`, `missing`); context overflow is
//!   400 `{"error":{"message":"This model's maximum context length is M
//!   tokens. However, you requested N tokens (N in the messages, None in the
//!   completion). Please reduce the length of the messages or
//!   completion.","type":"invalid_request_error","param":"messages","code":"context_length_exceeded"}}`
//!   (llama-cpp-python's rewrite of llama.cpp's `Requested tokens (N) exceed
//!   context window of M`); unknown paths 404 `{"detail":"Not Found"}`.
//! - `vllm`: structured outputs and native tools; every error is HTTP 400 with
//!   a top-level `{"object":"error","message","type":"BadRequestError",
//!   "param":null,"code":400}`, context overflow's message `This model's
//!   maximum context length is M tokens. However, you requested N tokens (N
//!   in the messages, 0 in the completion). ...`; unknown paths 404
//!   `{"detail":"Not Found"}`.
//! - `ollama` (its OpenAI-compatible endpoint): structured outputs and native
//!   tools, but a streamed tool call arrives whole in one chunk and there is
//!   no usage chunk even with `include_usage`; errors
//!   `{"error":{"message","type":"invalid_request_error","param":null,"code":null}}`
//!   HTTP 400; context overflow is silent: the oldest messages after the
//!   system prompt are dropped until the rest fit, and the answer is normal;
//!   unknown paths 404 `404 page not found` (text/plain).
//!
//! The injected faults other than `context_exceeded` keep their own (OpenAI)
//! shapes under every provider.
//!
//! # Text tool protocol
//! For servers without native tools the runtime describes the tools in the
//! system prompt instead. When a system message contains `<tool_call>{"name": `
//! (the protocol's instruction line) the sim, under any provider, plays the
//! same plan with the tools named in that block (`search`, `fetch`), but
//! answers with content lines `<tool_call>{"name": "search", "arguments":
//! {"q": "..."}}</tool_call>` and finish_reason `stop`. Earlier calls are read
//! from the assistant messages' `<tool_call>` lines, results from user
//! messages `<tool_result name="TOOL">...</tool_result>` (which are not the
//! prompt).
//!
//! # Faults
//! Three sources, checked in this order; the first that fires wins:
//! 1. the request header `x-sim-fault: <kind>` (always fires);
//! 2. the rules of the `--faults FILE` (env `LH_SIM_FAULTS`);
//! 3. `LH_SIM_FAULT_RATE` (0..1) with `LH_SIM_FAULT_KINDS` (comma-separated,
//!    default `cut,empty,error_event,rate_limit,overloaded`): each request
//!    faults with that probability, the kind chosen by the seed.
//!
//! Fault kinds: `cut` (stream ends after some content, before the finish
//! signal), `empty` (HTTP 200, no events), `error_event` (an error object
//! mid-stream, then `[DONE]`, as vLLM does), `rate_limit` (429 with
//! `Retry-After`), `quota` (429 `insufficient_quota`), `server_error` (500),
//! `overloaded` (503), `hang` (never answers), `slow` (tokens paced at
//! `delay_ms`, default 200), `malformed_args` (tool-call arguments that are
//! not JSON), `context_exceeded` (the provider's context-length error),
//! `refusal` (a refusal delta), `html` (HTTP 200 `text/html`, a web server's
//! welcome page: the wrong URL), `not_found` (404 `{"detail":"Not Found"}`),
//! `unauthorized` (401 `{"error":{"message":"Incorrect API key
//! provided","type":"invalid_request_error","code":"invalid_api_key"}}`),
//! `invalid_request_500` (500 with llama-cpp-python's validation body, under
//! any provider).
//!
//! The fault file is JSON:
//! ```json
//! {"rules": [
//!   {"kind": "cut", "nth": [2, 5]},
//!   {"kind": "rate_limit", "every": 4, "retry_after": "1"},
//!   {"kind": "overloaded", "rate": 0.1, "times": 3},
//!   {"kind": "context_exceeded", "above_chars": 20000},
//!   {"kind": "slow", "rate": 0.5, "delay_ms": 50, "match": "reliability"}
//! ]}
//! ```
//! Rule fields: `kind` (required); when it fires: `nth` (1-based numbers of
//! chat requests since start), `every` (every Nth request), `rate`
//! (probability from the seed), `after` (only from the Nth request on),
//! `times` (fire at most this often), `match` (only when the last user
//! message contains this text), `above_chars` (only when the request's
//! messages exceed this many characters; alone, it fires on every such
//! request); parameters: `retry_after` (seconds, for `rate_limit`),
//! `delay_ms` (for `slow`). A rule with no condition fires on every request.
//!
//! # Pacing
//! `LH_SIM_TOKEN_DELAY_MS` (default 2) between streamed tokens; 0 for tests.
//!
//! # One request at a time
//! `--serve` (env `LH_SIM_SERVE`): `parallel` (default), `serialized` (one
//! generation at a time, the others wait) or `interrupts` (one at a time,
//! and a newcomer ends the stream in flight with `[DONE]` before its finish
//! reason, as llama-cpp-python's server does); see [`serve`].

mod faults;
pub mod limits;
mod play;
mod provider;
mod schema;
pub mod serve;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use serde_json::{json, Value};

use faults::{FaultKind, Faults};
pub use provider::Provider;
use provider::{openai_error, Problem};

/// Counts served, for `GET /stats`.
#[derive(Default)]
struct Stats {
    chat_requests: u64,
    streaming: u64,
    faults: BTreeMap<String, u64>,
    tool_calls_proposed: u64,
    by_tool: BTreeMap<String, u64>,
    response_formats: BTreeMap<&'static str, u64>,
    tools_offered: u64,
    text_tool_calls: u64,
    /// 429s for a limit (`--limit`), by which limit.
    rate_limited: BTreeMap<&'static str, u64>,
    /// Prompt + completion tokens of the requests admitted (not refused).
    tokens_admitted: u64,
}

struct Sim {
    seed: u64,
    provider: Provider,
    context_chars: usize,
    faults: Faults,
    token_delay: Duration,
    counter: AtomicU64,
    stats: Mutex<Stats>,
    limits: Arc<limits::Limits>,
    /// How many generations at once (`--serve`).
    model: Arc<serve::Model>,
}

/// The model routes.
pub fn router(args: &crate::Args) -> anyhow::Result<Router> {
    let faults = Faults::load(args.faults.as_deref(), args.seed)?;
    let token_delay = std::env::var("LH_SIM_TOKEN_DELAY_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .map(Duration::from_millis)
        .unwrap_or(Duration::from_millis(2));
    let mut stats = Stats::default();
    for k in ["json_schema", "json_object", "json_object_schema", "none"] {
        stats.response_formats.insert(k, 0);
    }
    let sim = Arc::new(Sim {
        seed: args.seed,
        provider: args.provider,
        context_chars: args.context_chars,
        faults,
        token_delay,
        counter: AtomicU64::new(0),
        stats: Mutex::new(stats),
        limits: Arc::new(limits::Limits::new(&args.limit, args.retry_after_form)),
        model: serve::Model::new(args.serve),
    });
    Ok(Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/models", get(models))
        .route("/stats", get(stats_handler))
        .route("/limits", get(limits_list).post(limits_set))
        .fallback(unknown_path)
        .with_state(sim))
}

async fn stats_handler(State(sim): State<Arc<Sim>>) -> Json<Value> {
    let s = sim.stats.lock().expect("stats lock");
    Json(json!({
        "chat_requests": s.chat_requests,
        "streaming_requests": s.streaming,
        "faults": s.faults,
        "faults_total": s.faults.values().sum::<u64>(),
        "tool_calls_proposed": s.tool_calls_proposed,
        "tool_calls_by_name": s.by_tool,
        "response_formats": s.response_formats,
        "tools_offered": s.tools_offered,
        "text_tool_calls": s.text_tool_calls,
        "rate_limited": s.rate_limited,
        "rate_limited_total": s.rate_limited.values().sum::<u64>(),
        "tokens_admitted": s.tokens_admitted,
        "requests_during_retry_after": sim.limits.early(),
        "provider": sim.provider.name(),
        "serve": sim.model.mode.name(),
        "interrupted": sim.model.interrupted.load(Ordering::Relaxed),
        "waited": sim.model.waited.load(Ordering::Relaxed),
        "generating_peak": sim.model.generating_peak.load(Ordering::SeqCst),
    }))
}

async fn limits_list(State(sim): State<Arc<Sim>>) -> Json<Value> {
    Json(sim.limits.list())
}

/// `POST /limits`: sets one model's limits (all absent: removes them).
async fn limits_set(State(sim): State<Arc<Sim>>, body: Bytes) -> Response {
    let spec: limits::LimitSpec = match serde_json::from_slice(&body) {
        Ok(s) => s,
        Err(e) => return (StatusCode::BAD_REQUEST, format!("bad limits: {e}\n")).into_response(),
    };
    if let Err(e) = spec.check() {
        return (StatusCode::BAD_REQUEST, format!("bad limits: {e}\n")).into_response();
    }
    sim.limits.set(spec);
    Json(sim.limits.list()).into_response()
}

async fn models() -> Json<Value> {
    Json(json!({"object": "list", "data": [
        {"id": "sim-1", "object": "model", "owned_by": "leasehold-sim"}
    ]}))
}

async fn unknown_path(State(sim): State<Arc<Sim>>, method: Method, uri: Uri) -> Response {
    sim.provider.not_found(method.as_str(), uri.path())
}

/// What `GET /stats` files a request's `response_format` under.
fn format_kind(req: &Value) -> &'static str {
    let fmt = req.get("response_format");
    match fmt.and_then(|f| f.get("type")).and_then(Value::as_str) {
        Some("json_schema") => "json_schema",
        Some("json_object") if fmt.and_then(|f| f.get("schema")).is_some() => "json_object_schema",
        Some("json_object") => "json_object",
        _ => "none",
    }
}

fn chars_of(messages: &[Value]) -> usize {
    messages.iter().map(|m| m.to_string().len()).sum()
}

/// Ollama's silent overflow: the oldest messages after the system prompt go
/// until the rest fit (the last message always stays).
fn truncate_to(messages: &mut Vec<Value>, limit: usize) {
    while chars_of(messages) > limit {
        let Some(i) = messages
            .iter()
            .position(|m| m["role"] != "system" && m["role"] != "developer")
        else {
            break;
        };
        if i + 1 >= messages.len() {
            break;
        }
        messages.remove(i);
    }
}

const HTML_PAGE: &str = "<!DOCTYPE html>\n<html>\n<head><title>Welcome</title></head>\n<body>\n<h1>Welcome</h1>\n<p>If you see this page, the web server is working. Nothing else is configured here.</p>\n</body>\n</html>\n";

async fn chat(State(sim): State<Arc<Sim>>, headers: HeaderMap, body: Bytes) -> Response {
    let n = sim.counter.fetch_add(1, Ordering::SeqCst) + 1;
    let provider = sim.provider;
    let req: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return provider.bad_request(Problem::InvalidJson, &e.to_string()),
    };
    let Some(messages) = req.get("messages").and_then(Value::as_array) else {
        return provider.bad_request(Problem::MissingMessages, "");
    };
    let mut messages = messages.clone();
    let stream = req.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let include_usage = req
        .pointer("/stream_options/include_usage")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let model = req
        .get("model")
        .and_then(Value::as_str)
        .unwrap_or("sim-1")
        .to_string();
    let host = headers
        .get("host")
        .and_then(|h| h.to_str().ok())
        .unwrap_or("127.0.0.1:8089")
        .to_string();
    let mut prompt_chars = chars_of(&messages);
    let last_user = play::last_user(&messages);
    let format = format_kind(&req);
    let tools_offered = req
        .get("tools")
        .and_then(Value::as_array)
        .is_some_and(|t| !t.is_empty());

    let header_fault = headers
        .get("x-sim-fault")
        .and_then(|h| h.to_str().ok())
        .and_then(FaultKind::parse);
    let fault = header_fault
        .map(|k| (k, faults::Params::default()))
        .or_else(|| sim.faults.pick(n, &last_user, prompt_chars));
    {
        let mut s = sim.stats.lock().expect("stats lock");
        s.chat_requests += 1;
        if stream {
            s.streaming += 1;
        }
        if let Some((k, _)) = &fault {
            *s.faults.entry(k.name().to_string()).or_default() += 1;
        }
        *s.response_formats.entry(format).or_default() += 1;
        if tools_offered {
            s.tools_offered += 1;
        }
    }
    let (kind, params) = match fault {
        Some((k, p)) => (Some(k), p),
        None => (None, faults::Params::default()),
    };
    tracing::debug!(n, ?kind, stream, "chat request");
    match kind {
        Some(FaultKind::RateLimit) => {
            let mut r = openai_error(StatusCode::TOO_MANY_REQUESTS, "Rate limit reached (simulated)", "requests", json!("rate_limit_exceeded"));
            let ra = params.retry_after.clone().unwrap_or_else(|| "1".into());
            r.headers_mut().insert("retry-after", ra.parse().unwrap_or_else(|_| "1".parse().expect("valid header")));
            return r;
        }
        Some(FaultKind::Quota) => {
            return openai_error(StatusCode::TOO_MANY_REQUESTS, "You exceeded your current quota (simulated)", "insufficient_quota", json!("insufficient_quota"))
        }
        Some(FaultKind::ServerError) => return openai_error(StatusCode::INTERNAL_SERVER_ERROR, "Internal server error (simulated)", "server_error", json!("server_error")),
        Some(FaultKind::Overloaded) => return openai_error(StatusCode::SERVICE_UNAVAILABLE, "The server is overloaded (simulated)", "overloaded_error", json!("overloaded")),
        Some(FaultKind::ContextExceeded) => return provider.context_exceeded(prompt_chars, None),
        Some(FaultKind::Html) => {
            return (StatusCode::OK, [("content-type", "text/html; charset=utf-8")], HTML_PAGE).into_response()
        }
        Some(FaultKind::NotFound) => return provider::not_found_detail(),
        Some(FaultKind::Unauthorized) => {
            return (
                StatusCode::UNAUTHORIZED,
                Json(json!({"error": {"message": "Incorrect API key provided", "type": "invalid_request_error", "code": "invalid_api_key"}})),
            )
                .into_response()
        }
        Some(FaultKind::InvalidRequest500) => return provider::llama_json_schema_refusal(),
        Some(FaultKind::Hang) => {
            // Never answer; the client's timeout ends it and drops this future.
            futures::future::pending::<()>().await;
            unreachable!()
        }
        _ => {}
    }
    if format == "json_schema" && !provider.takes_json_schema() {
        return provider::llama_json_schema_refusal();
    }
    if sim.context_chars > 0 && prompt_chars > sim.context_chars {
        if provider.refuses_overflow() {
            return provider.context_exceeded(prompt_chars, Some(sim.context_chars));
        }
        truncate_to(&mut messages, sim.context_chars);
        tracing::debug!(
            n,
            before = prompt_chars,
            after = chars_of(&messages),
            "prompt truncated"
        );
        prompt_chars = chars_of(&messages);
    }

    // What the agent does next.
    let seed = sim.seed ^ play::hash64(&body);
    let mut turn = play::decide(&req, &messages, &host, seed, provider);
    if kind == Some(FaultKind::Refusal) {
        turn = play::Turn::Refusal("I can't help with that request.".into());
    }
    if kind == Some(FaultKind::MalformedArgs) {
        if let Some(call) = turn.calls_mut().and_then(|c| c.first_mut()) {
            call.arguments = call
                .arguments
                .trim_end_matches('}')
                .trim_end_matches('"')
                .to_string();
        }
    }
    let text_protocol = matches!(turn, play::Turn::TextTools(_));
    if let Some(calls) = turn.calls_mut() {
        let mut s = sim.stats.lock().expect("stats lock");
        for c in calls.iter() {
            s.tool_calls_proposed += 1;
            *s.by_tool.entry(c.name.clone()).or_default() += 1;
            if text_protocol {
                s.text_tool_calls += 1;
            }
        }
    }
    let completion_chars = turn.size();
    let usage = json!({
        "prompt_tokens": prompt_chars.div_ceil(4),
        "completion_tokens": completion_chars.div_ceil(4),
        "total_tokens": prompt_chars.div_ceil(4) + completion_chars.div_ceil(4),
    });
    let admitted = match sim.limits.admit(
        &model,
        prompt_chars.div_ceil(4) as u64,
        completion_chars.div_ceil(4) as u64,
    ) {
        Ok(a) => {
            sim.stats.lock().expect("stats lock").tokens_admitted +=
                (prompt_chars.div_ceil(4) + completion_chars.div_ceil(4)) as u64;
            a
        }
        Err(refusal) => {
            *sim.stats
                .lock()
                .expect("stats lock")
                .rate_limited
                .entry(refusal.exceeded.name())
                .or_default() += 1;
            let mut r = openai_error(
                StatusCode::TOO_MANY_REQUESTS,
                &format!(
                    "Rate limit reached for {model} on {} (simulated limit)",
                    refusal.exceeded.name()
                ),
                "requests",
                json!("rate_limit_exceeded"),
            );
            if let Ok(v) = refusal.retry_after.parse() {
                r.headers_mut().insert("retry-after", v);
            }
            return r;
        }
    };
    let id = format!("chatcmpl-sim{}", &hex::encode(seed.to_be_bytes())[..12]);
    if !stream {
        if kind == Some(FaultKind::Empty) || kind == Some(FaultKind::Cut) {
            // The non-streaming analogue of a cut: a 200 with a truncated body.
            return (
                StatusCode::OK,
                [("content-type", "application/json")],
                "{\"id\":\"x\",\"choices\":[",
            )
                .into_response();
        }
        if kind == Some(FaultKind::ErrorEvent) {
            return (StatusCode::OK, Json(json!({"error": {"message": "model overloaded mid-generation (simulated)", "type": "overloaded_error", "code": 503}}))).into_response();
        }
        if sim.model.mode != serve::Serve::Parallel {
            // One at a time: it holds the model while it generates.
            let _turn = sim.model.turn().await;
            let tokens = play::stream_chunks(&id, &model, &turn, false).len() as u32;
            tokio::time::sleep(sim.token_delay * tokens).await;
        }
        return Json(play::full_response(&id, &model, &turn, usage)).into_response();
    }

    let delay = match kind {
        Some(FaultKind::Slow) => Duration::from_millis(params.delay_ms.unwrap_or(200)),
        _ => sim.token_delay,
    };
    let mut events: Vec<String> =
        play::stream_chunks(&id, &model, &turn, provider.whole_tool_calls());
    let finish_at = events.len() - 1; // the last chunk carries finish_reason
    match kind {
        Some(FaultKind::Empty) => events.clear(),
        Some(FaultKind::Cut) => events.truncate((finish_at / 2).max(1)),
        Some(FaultKind::ErrorEvent) => {
            events.truncate((finish_at / 2).max(1));
            events.push(json!({"error": {"message": "The model is overloaded (simulated)", "type": "overloaded_error", "code": 503}}).to_string());
            events.push("[DONE]".into());
        }
        _ => {
            if include_usage && provider.usage_chunk() {
                events.push(json!({"id": id, "object": "chat.completion.chunk", "created": 0, "model": model, "choices": [], "usage": usage}).to_string());
            }
            events.push("[DONE]".into());
        }
    }
    // The concurrency slot is held until the stream ends or is dropped;
    // the model's turn (one at a time) from the first chunk on. Events
    // after the finish reason: a cut among them loses the client nothing.
    let after_finish = events.len().saturating_sub(finish_at + 1);
    let server = sim.model.clone();
    let body = futures::stream::unfold(
        (
            events.into_iter(),
            true,
            Some(admitted),
            None::<serve::Turn>,
        ),
        move |(mut it, first, mut admitted, mut turn)| {
            let server = server.clone();
            async move {
                if first {
                    // Headers are out; the first chunk waits for the model,
                    // then for its prompt's evaluation (a token's time).
                    turn = Some(server.turn().await);
                    if server.mode != serve::Serve::Parallel && !delay.is_zero() {
                        tokio::time::sleep(delay).await;
                    }
                } else if turn.is_some()
                    && it.len() > 0
                    && server.cut_for_newcomer(it.len() > after_finish)
                {
                    // A newcomer waits: this stream ends here, no finish
                    // reason (llama-cpp-python's interrupt_requests).
                    let done = Bytes::from_static(b"data: [DONE]\n\n");
                    it = Vec::new().into_iter();
                    return Some((Ok(done), (it, false, None, None)));
                }
                let ev = it.next()?;
                if it.len() == 0 {
                    // The last event: the slots are free before the client sees the end.
                    admitted = None;
                    turn = None;
                }
                if !first && !delay.is_zero() {
                    tokio::time::sleep(delay).await;
                }
                Some((
                    Ok::<Bytes, std::convert::Infallible>(Bytes::from(format!("data: {ev}\n\n"))),
                    (it, false, admitted, turn),
                ))
            }
        },
    );
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "text/event-stream")
        .header("cache-control", "no-cache")
        .body(Body::from_stream(body))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}
