//! The HTTP client: one generation attempt, streaming or not.
//!
//! Completion is decided at the protocol layer. A generation is complete only
//! when a `finish_reason` arrived and the stream then ended cleanly (or with
//! `[DONE]`). A stream that ends first, including an HTTP 200 with no events
//! at all, is [`ModelError::Incomplete`]; an explicit error object is a
//! [`ModelError::StreamError`] with its own class, whatever the HTTP status
//! and whether or not `[DONE]` follows it. SSE framing is parsed by the
//! `eventsource-stream` crate.
//!
//! Architecture Invariant: this client never retries. reqwest's own retry
//! policy is switched off; the generation retry loop in [`crate::retry`] is
//! the one retry layer.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use eventsource_stream::{EventStreamError, Eventsource};
use futures::stream::{self, BoxStream, StreamExt};
use leasehold_transcript::{Message, ToolCall};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::adapt::{self, Provider, Providers, StructuredForm, ToolsForm};
use crate::config::ModelConfig;
use crate::error::{classify, http_error, ErrorBody, ModelError};
use crate::wire::{ChatRequest, Chunk, FullResponse, Usage};

/// One decoded piece of a streamed response.
#[derive(Debug, Clone, PartialEq)]
pub enum Delta {
    Content(String),
    Refusal(String),
    /// A fragment of tool call `index`: id and name usually only in the first.
    ToolCall {
        index: usize,
        id: Option<String>,
        name: Option<String>,
        arguments: String,
    },
    Finish(String),
    Usage(Usage),
    /// An SSE event type or tool kind this client does not know (hosted
    /// tools, provider extensions). It makes a fresh retry ineligible.
    Unknown(String),
    Done,
}

/// Receives visible text as it streams (a watcher: a UI, a progress event).
/// Once anything reached it, a fresh generation retry is refused.
pub type Watcher = Arc<dyn Fn(&str) + Send + Sync>;

/// What one attempt has shown so far; read by the restart-eligibility rule.
#[derive(Clone, Default)]
pub struct AttemptState {
    pub watcher: Option<Watcher>,
    /// Text reached the watcher.
    pub visible_output: bool,
    /// A tool-call fragment arrived (never executed unless complete).
    pub tool_call_seen: bool,
    /// An unknown or hosted-tool event arrived.
    pub unknown_event: bool,
    /// The generation reached its successful terminal signal.
    pub completed: bool,
    /// Time from sending to the first content or tool-call fragment.
    pub first_token: Option<Duration>,
    /// The forms the request was sent in (see [`crate::adapt`]).
    pub sent_forms: Option<(StructuredForm, ToolsForm)>,
    /// Called once, when the first content or tool-call token streams in
    /// (flow control's sign that the provider is generating this request).
    pub on_first_token: Option<Arc<dyn Fn() + Send + Sync>>,
    /// The server ended the stream itself (`[DONE]`) before a finish
    /// reason: it cut the generation, deliberately (as llama-cpp-python's
    /// server does for a newcomer), unlike a connection that just stops.
    pub cut_short: bool,
    /// When the stream's last chunk came (before its end).
    pub last_chunk: Option<Instant>,
}

impl std::fmt::Debug for AttemptState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AttemptState")
            .field("visible_output", &self.visible_output)
            .field("tool_call_seen", &self.tool_call_seen)
            .field("unknown_event", &self.unknown_event)
            .field("completed", &self.completed)
            .field("cut_short", &self.cut_short)
            .finish()
    }
}

/// A complete model response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Completion {
    pub content: String,
    pub tool_calls: Vec<ToolCall>,
    pub finish_reason: String,
    pub usage: Usage,
    pub model: String,
    /// Whether `[DONE]` was seen (informational unless a quirk requires it).
    pub done_seen: bool,
    #[serde(with = "opt_ms")]
    pub first_token: Option<Duration>,
    #[serde(with = "ms")]
    pub elapsed: Duration,
}

impl Completion {
    /// The assistant message to append to the transcript.
    pub fn message(&self) -> Message {
        Message::Assistant {
            content: (!self.content.is_empty() || self.tool_calls.is_empty())
                .then(|| self.content.clone()),
            tool_calls: self.tool_calls.clone(),
            refusal: None,
            partial: false,
        }
    }
}

/// Errors of the byte transport under the SSE parser.
#[derive(Debug)]
enum Transport {
    Timeout { first: bool },
    Http(reqwest::Error),
}

impl std::fmt::Display for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Transport::Timeout { first } => write!(f, "timeout (first chunk: {first})"),
            Transport::Http(e) => write!(f, "{}", chain(e)),
        }
    }
}

/// The OpenAI-compatible client.
#[derive(Debug, Clone)]
pub struct ModelClient {
    http: reqwest::Client,
    cfg: ModelConfig,
    /// What is known of the providers it talks to (shared with the other
    /// clients of a worker's kind through [`ModelClient::sharing`]).
    providers: Arc<Providers>,
}

impl ModelClient {
    pub fn new(cfg: ModelConfig) -> Result<Self, ModelError> {
        let http = reqwest::Client::builder()
            .connect_timeout(cfg.connect_timeout)
            // One retry layer only: the generation loop.
            .retry(reqwest::retry::never())
            .build()
            .map_err(|e| ModelError::Config(e.to_string()))?;
        Ok(ModelClient {
            http,
            cfg,
            providers: Arc::default(),
        })
    }

    /// Shares what `providers` knows (and learns) of each provider with
    /// the other clients holding it (a worker's kind makes one client per
    /// job; its provider records outlive the job).
    pub fn sharing(mut self, providers: Arc<Providers>) -> Self {
        self.providers = providers;
        self
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// What this client (and those sharing its records) knows of the
    /// provider serving `model`.
    pub fn provider(&self, model: &str) -> Arc<Provider> {
        self.providers.get(
            &self.cfg.base_url,
            model,
            self.cfg.structured,
            self.cfg.tools,
        )
    }

    /// Whether the endpoint answers at all (`GET <base>/models`, bounded by
    /// `within`): `Err` carries the cause and the setting to check. For a
    /// warning at start; a job never depends on it.
    pub async fn reachable(&self, within: Duration) -> Result<(), String> {
        let full = format!("{}/models", self.cfg.base_url.trim_end_matches('/'));
        let mut rb = self.http.get(&full);
        let url = leasehold_telemetry::redact_url(&full);
        if let Some(key) = &self.cfg.api_key {
            rb = rb.bearer_auth(key);
        }
        match tokio::time::timeout(within, rb.send()).await {
            Err(_) => Err(format!("no answer from {url} within {within:?}")),
            Ok(Err(e)) => Err(format!("{url}: {}; check LH_MODEL_BASE_URL", chain(&e))),
            Ok(Ok(r)) if r.status().as_u16() == 401 || r.status().as_u16() == 403 => {
                Err(format!("{url} answered {}; check LH_API_KEY", r.status()))
            }
            Ok(Ok(r)) if r.status().is_success() => {
                // A model list is the API answering: this provider is reachable.
                let listed = r
                    .json::<serde_json::Value>()
                    .await
                    .ok()
                    .is_some_and(|v| v.get("data").is_some_and(|d| d.is_array()));
                if !listed {
                    return Err(format!(
                        "{url} answered without a model list (not an OpenAI-compatible API?); check LH_MODEL_BASE_URL"
                    ));
                }
                self.provider(&self.cfg.model).mark_answered();
                Ok(())
            }
            Ok(Ok(r)) => Err(format!(
                "{url} answered {}; check LH_MODEL_BASE_URL",
                r.status()
            )),
        }
    }

    /// The endpoint answered 2xx with something that is not the API.
    fn not_the_api(&self, what: &str) -> ModelError {
        ModelError::Config(format!(
            "the model endpoint {} answered {what}, not an OpenAI-compatible response: check LH_MODEL_BASE_URL (the base up to and including /v1)",
            leasehold_telemetry::redact_url(&self.cfg.chat_url())
        ))
    }

    async fn send(
        &self,
        req: &ChatRequest,
        model: &str,
        stream: bool,
        state: &mut AttemptState,
    ) -> Result<reqwest::Response, ModelError> {
        let forms = self.provider(model).forms();
        state.sent_forms = Some(forms);
        let mut body = adapt::shape(req, forms);
        body.max_tokens = body.max_tokens.or(self.cfg.max_tokens);
        if body.model.is_empty() || body.model != model {
            body.model = model.to_string();
        }
        body.stream = stream;
        if stream && !self.cfg.quirks.no_stream_options {
            body.stream_options = Some(serde_json::json!({"include_usage": true}));
        } else {
            body.stream_options = None;
        }
        let mut rb = self.http.post(self.cfg.chat_url()).json(&body);
        if let Some(key) = &self.cfg.api_key {
            rb = rb.bearer_auth(key);
        }
        let resp = match tokio::time::timeout(self.cfg.first_byte_timeout, rb.send()).await {
            Err(_) => return Err(ModelError::ReadTimeout("response headers")),
            Ok(Err(e)) if e.is_connect() => return Err(ModelError::Connect(chain(&e))),
            Ok(Err(e)) if e.is_timeout() => {
                return Err(ModelError::ReadTimeout("response headers"))
            }
            Ok(Err(e)) => return Err(ModelError::Reset(chain(&e))),
            Ok(Ok(r)) => r,
        };
        if !resp.status().is_success() {
            let status = resp.status().as_u16();
            let headers = resp.headers().clone();
            let text = match tokio::time::timeout(self.cfg.idle_timeout, resp.text()).await {
                Ok(Ok(t)) => t,
                _ => String::new(),
            };
            return Err(http_error(status, &headers, &text));
        }
        let ct = content_type(&resp);
        if ct.starts_with("text/html") {
            return Err(self.not_the_api(&format!("{} {ct}", resp.status().as_u16())));
        }
        Ok(resp)
    }

    /// Opens a streaming generation and returns its decoded deltas. Errors
    /// before the first byte come back directly; later ones as stream items.
    pub async fn stream(
        &self,
        req: &ChatRequest,
        model: &str,
        state: &mut AttemptState,
    ) -> Result<BoxStream<'static, Result<Delta, ModelError>>, ModelError> {
        let resp = self.send(req, model, true, state).await?;
        Ok(Self::deltas(
            resp,
            self.cfg.first_byte_timeout,
            self.cfg.idle_timeout,
        ))
    }

    fn deltas(
        resp: reqwest::Response,
        first: Duration,
        idle: Duration,
    ) -> BoxStream<'static, Result<Delta, ModelError>> {
        let bytes = Box::pin(resp.bytes_stream());
        // Per-chunk timeouts: the first chunk may take long (prompt
        // processing), later silences are bounded by the idle timeout.
        let timed = stream::unfold(
            (bytes, true, false),
            move |(mut s, is_first, done)| async move {
                if done {
                    return None;
                }
                let limit = if is_first { first } else { idle };
                match tokio::time::timeout(limit, s.next()).await {
                    Err(_) => Some((
                        Err(Transport::Timeout { first: is_first }),
                        (s, false, true),
                    )),
                    Ok(None) => None,
                    Ok(Some(Ok(b))) => Some((Ok::<Bytes, Transport>(b), (s, false, false))),
                    Ok(Some(Err(e))) => Some((Err(Transport::Http(e)), (s, false, true))),
                }
            },
        );
        let deltas = timed
            .eventsource()
            .map(|item| match item {
                Ok(ev) => stream::iter(decode_event(&ev.event, &ev.data)),
                Err(e) => stream::iter(vec![Err(transport_error(e))]),
            })
            .flatten();
        deltas.boxed()
    }

    /// One generation attempt against `model`, assembled into a
    /// [`Completion`]. `state` records what the attempt showed, for the
    /// eligibility rule, even when it fails.
    pub async fn generate_once(
        &self,
        req: &ChatRequest,
        model: &str,
        state: &mut AttemptState,
    ) -> Result<Completion, ModelError> {
        let started = Instant::now();
        let c = if self.cfg.stream {
            let resp = self.send(req, model, true, state).await?;
            if content_type(&resp).starts_with("application/json") {
                // A server that ignores `stream: true` and answers whole.
                self.full_response(resp, req, model, state, started).await
            } else {
                self.streamed(resp, req, model, state, started).await
            }
        } else {
            let resp = self.send(req, model, false, state).await?;
            self.full_response(resp, req, model, state, started).await
        }?;
        Ok(self.adapted(c, req, state))
    }

    /// A completion read back into the canonical form: tool calls written
    /// in the text protocol become tool calls, a structured answer asked
    /// for in the prompt loses its wrapping.
    fn adapted(&self, mut c: Completion, req: &ChatRequest, state: &AttemptState) -> Completion {
        let Some((structured, tools)) = state.sent_forms else {
            return c;
        };
        if tools == ToolsForm::Text && !req.tools.is_empty() && c.tool_calls.is_empty() {
            let (calls, rest) = adapt::parse_text_tool_calls(&c.content);
            if !calls.is_empty() {
                c.tool_calls = calls;
                c.content = rest;
                c.finish_reason = "tool_calls".into();
            }
        }
        if structured != StructuredForm::JsonSchema
            && req.response_format.is_some()
            && c.tool_calls.is_empty()
        {
            c.content = adapt::extract_json(&c.content);
        }
        c
    }

    async fn streamed(
        &self,
        resp: reqwest::Response,
        req: &ChatRequest,
        model: &str,
        state: &mut AttemptState,
        started: Instant,
    ) -> Result<Completion, ModelError> {
        let mut s = Self::deltas(resp, self.cfg.first_byte_timeout, self.cfg.idle_timeout);
        let mut content = String::new();
        let mut refusal = String::new();
        let mut calls: BTreeMap<usize, (String, String, String)> = BTreeMap::new();
        let mut finish: Option<String> = None;
        let mut usage: Option<Usage> = None;
        let mut done = false;
        let mut events = 0usize;
        let mut generating = false;
        let mut first_token = |state: &AttemptState| {
            if !generating {
                generating = true;
                if let Some(hook) = &state.on_first_token {
                    hook();
                }
            }
        };
        while let Some(item) = s.next().await {
            events += 1;
            let item = match item {
                Ok(Delta::Done) => Delta::Done,
                Ok(d) => {
                    state.last_chunk = Some(Instant::now());
                    d
                }
                Err(e) => {
                    // A transport failure after the finish signal does not
                    // reopen the restart window: the response was complete.
                    if finish.is_some()
                        && matches!(e, ModelError::Reset(_) | ModelError::ReadTimeout(_))
                    {
                        state.completed = true;
                    }
                    return Err(e);
                }
            };
            match item {
                Delta::Done => {
                    done = true;
                    break;
                }
                Delta::Content(text) => {
                    state.first_token.get_or_insert(started.elapsed());
                    if !text.is_empty() {
                        first_token(state);
                    }
                    if !text.is_empty() {
                        if let Some(w) = &state.watcher {
                            w(&text);
                            state.visible_output = true;
                        }
                    }
                    content.push_str(&text);
                }
                Delta::Refusal(text) => refusal.push_str(&text),
                Delta::ToolCall {
                    index,
                    id,
                    name,
                    arguments,
                } => {
                    state.first_token.get_or_insert(started.elapsed());
                    first_token(state);
                    state.tool_call_seen = true;
                    let entry = calls.entry(index).or_default();
                    if let Some(id) = id.filter(|i| !i.is_empty()) {
                        entry.0 = id;
                    }
                    if let Some(name) = name.filter(|n| !n.is_empty()) {
                        if entry.1.is_empty() {
                            entry.1 = name;
                        }
                    }
                    entry.2.push_str(&arguments);
                }
                Delta::Finish(r) => finish = Some(r),
                Delta::Usage(u) => usage = Some(u),
                Delta::Unknown(_) => state.unknown_event = true,
            }
        }
        let Some(finish_reason) = finish else {
            state.cut_short = done;
            return Err(ModelError::Incomplete(if events == 0 {
                "stream ended with no events".into()
            } else {
                "stream ended before a finish_reason".into()
            }));
        };
        if self.cfg.quirks.require_done && !done {
            return Err(ModelError::Incomplete(
                "no [DONE] after finish_reason".into(),
            ));
        }
        let tool_calls = calls
            .into_iter()
            .map(|(index, (id, name, args))| {
                if name.is_empty() {
                    return Err(ModelError::Protocol(format!(
                        "tool call {index} has no name"
                    )));
                }
                let id = if id.is_empty() {
                    format!("call_{index}")
                } else {
                    id
                };
                Ok(ToolCall::new(id, name, args))
            })
            .collect::<Result<Vec<_>, _>>()?;
        state.completed = true;
        finish_checks(&finish_reason, &refusal)?;
        let usage = usage.unwrap_or_else(|| estimate(req, &content, &tool_calls));
        Ok(Completion {
            content,
            tool_calls,
            finish_reason,
            usage,
            model: model.to_string(),
            done_seen: done,
            first_token: state.first_token,
            elapsed: started.elapsed(),
        })
    }

    async fn full_response(
        &self,
        resp: reqwest::Response,
        req: &ChatRequest,
        model: &str,
        state: &mut AttemptState,
        started: Instant,
    ) -> Result<Completion, ModelError> {
        let body = match tokio::time::timeout(self.cfg.idle_timeout, resp.bytes()).await {
            Err(_) => return Err(ModelError::ReadTimeout("response body")),
            Ok(Err(e)) => return Err(ModelError::Reset(chain(&e))),
            Ok(Ok(b)) => b,
        };
        if body.iter().all(u8::is_ascii_whitespace) {
            return Err(ModelError::Incomplete("empty response body".into()));
        }
        if body.trim_ascii_start().starts_with(b"<") {
            return Err(self.not_the_api("an HTML or XML document"));
        }
        let full: FullResponse = serde_json::from_slice(&body).map_err(|e| {
            ModelError::Incomplete(format!(
                "response body is not a complete JSON response: {e}"
            ))
        })?;
        if let Some(err) = full.error {
            return Err(stream_error(&err));
        }
        let Some(choice) = full.choices.into_iter().next() else {
            return Err(ModelError::Incomplete("response has no choices".into()));
        };
        let Some(finish_reason) = choice.finish_reason else {
            return Err(ModelError::Incomplete(
                "response has no finish_reason".into(),
            ));
        };
        state.first_token = Some(started.elapsed());
        state.completed = true;
        let content = choice.message.content.unwrap_or_default();
        if !content.is_empty() {
            if let Some(w) = &state.watcher {
                w(&content);
                state.visible_output = true;
            }
        }
        finish_checks(
            &finish_reason,
            choice.message.refusal.as_deref().unwrap_or(""),
        )?;
        let tool_calls = choice.message.tool_calls;
        let usage = full
            .usage
            .unwrap_or_else(|| estimate(req, &content, &tool_calls));
        Ok(Completion {
            content,
            tool_calls,
            finish_reason,
            usage,
            model: full.model.unwrap_or_else(|| model.to_string()),
            done_seen: true,
            first_token: state.first_token,
            elapsed: started.elapsed(),
        })
    }
}

fn finish_checks(finish_reason: &str, refusal: &str) -> Result<(), ModelError> {
    if finish_reason == "content_filter" {
        return Err(ModelError::ContentFilter);
    }
    if !refusal.is_empty() {
        return Err(ModelError::Refusal(refusal.to_string()));
    }
    Ok(())
}

fn estimate(req: &ChatRequest, content: &str, calls: &[ToolCall]) -> Usage {
    let prompt = leasehold_transcript::size_chars(&req.messages);
    let out = content.len()
        + calls
            .iter()
            .map(|c| c.function.name.len() + c.function.arguments.len())
            .sum::<usize>();
    Usage::estimate(prompt, out)
}

fn stream_error(obj: &crate::error::ErrorObject) -> ModelError {
    ModelError::StreamError {
        class: classify(None, obj),
        code: obj.code_string().or(obj.kind.clone()),
        message: obj.message.clone().unwrap_or_default(),
    }
}

/// Decodes one SSE event into deltas.
fn decode_event(event: &str, data: &str) -> Vec<Result<Delta, ModelError>> {
    let data = data.trim();
    if event == "error" {
        let obj = serde_json::from_str::<ErrorBody>(data)
            .map(|b| b.error)
            .or_else(|_| serde_json::from_str(data))
            .unwrap_or_else(|_| crate::error::ErrorObject {
                message: Some(data.to_string()),
                ..Default::default()
            });
        return vec![Err(stream_error(&obj))];
    }
    if data == "[DONE]" {
        return vec![Ok(Delta::Done)];
    }
    if event != "message" {
        return vec![Ok(Delta::Unknown(event.to_string()))];
    }
    let chunk: Chunk = match serde_json::from_str(data) {
        Ok(c) => c,
        Err(e) => return vec![Err(ModelError::Protocol(format!("chunk is not JSON: {e}")))],
    };
    if let Some(err) = chunk.error {
        return vec![Err(stream_error(&err))];
    }
    let _ = chunk.model;
    let mut out = Vec::new();
    for choice in chunk.choices {
        if let Some(delta) = choice.delta {
            if let Some(c) = delta.content {
                out.push(Ok(Delta::Content(c)));
            }
            if let Some(r) = delta.refusal {
                out.push(Ok(Delta::Refusal(r)));
            }
            for (pos, tc) in delta.tool_calls.unwrap_or_default().into_iter().enumerate() {
                if let Some(kind) = tc.kind.as_deref().filter(|k| *k != "function") {
                    out.push(Ok(Delta::Unknown(format!("tool type {kind}"))));
                    continue;
                }
                let (name, arguments) = tc
                    .function
                    .map(|f| (f.name, f.arguments.unwrap_or_default()))
                    .unwrap_or_default();
                out.push(Ok(Delta::ToolCall {
                    index: tc.index.unwrap_or(pos),
                    id: tc.id,
                    name,
                    arguments,
                }));
            }
        }
        if let Some(r) = choice.finish_reason {
            out.push(Ok(Delta::Finish(r)));
        }
    }
    if let Some(u) = chunk.usage {
        out.push(Ok(Delta::Usage(u)));
    }
    out
}

fn transport_error(e: EventStreamError<Transport>) -> ModelError {
    match e {
        EventStreamError::Utf8(e) => ModelError::Protocol(format!("stream is not UTF-8: {e}")),
        EventStreamError::Parser(e) => ModelError::Protocol(format!("bad SSE framing: {e}")),
        EventStreamError::Transport(Transport::Timeout { first: true }) => {
            ModelError::ReadTimeout("the first body chunk")
        }
        EventStreamError::Transport(Transport::Timeout { first: false }) => {
            ModelError::ReadTimeout("the next body chunk (idle)")
        }
        EventStreamError::Transport(Transport::Http(e)) if e.is_timeout() => {
            ModelError::ReadTimeout("body")
        }
        EventStreamError::Transport(t) => ModelError::Reset(t.to_string()),
    }
}

fn content_type(resp: &reqwest::Response) -> String {
    resp.headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_ascii_lowercase()
}

/// An error with its sources, since reqwest's top-level message hides the cause.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}

mod ms {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(d.as_millis() as u64)
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        Ok(Duration::from_millis(u64::deserialize(d)?))
    }
}

mod opt_ms {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => s.serialize_some(&(d.as_millis() as u64)),
            None => s.serialize_none(),
        }
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        Ok(Option::<u64>::deserialize(d)?.map(Duration::from_millis))
    }
}
