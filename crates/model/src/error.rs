//! The one error of the crate and its failure classes.
//!
//! Every failure maps to one [`FailureClass`] through a single `match`
//! ([`ModelError::class`]); the class says what to do
//! ([`FailureClass::action`]) and whether a fresh generation may help
//! ([`FailureClass::is_retryable`]). Providers disagree on how they say a
//! thing (vLLM's integer codes, code-less context errors, a 429 that is
//! really an exhausted quota), so the parsing of their error objects is also
//! here, in one place.

use std::time::{Duration, SystemTime};

use reqwest::header::HeaderMap;
use serde::{Deserialize, Serialize};

use crate::budget::BudgetKind;

/// What kind of failure happened, following the seed's table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureClass {
    RateLimited,
    QuotaExhausted,
    Overloaded,
    ServerError,
    ReadTimeout,
    ConnectionReset,
    ConnectFailed,
    IncompleteGeneration,
    Protocol,
    ContextExceeded,
    MalformedOutput,
    InvalidToolArguments,
    ToolFailed,
    UncertainEffect,
    Auth,
    Permission,
    BadRequest,
    Refusal,
    ContentFilter,
    Loop,
    CircuitOpen,
    Cancelled,
    DeadlineExceeded,
    BudgetExhausted,
    RetryRefused,
    Config,
}

/// What the runtime does about a class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// Retry after backoff (and any server-stated delay).
    Retry,
    /// Sanitize, compact, and retry warm; cold if that cannot be shown sound.
    RepairContext,
    /// Ask again once with the validator's message.
    ReAsk,
    /// Give the error to the model as the tool result.
    ReturnToModel,
    /// Stop for a person: refusal, content filter, loop, uncertain effect.
    Park,
    /// Fail; retrying cannot help.
    Terminal,
    /// Stop because the caller said so or the job's limits are reached.
    Stop,
}

impl FailureClass {
    /// The action for this class: one `match`, the table in code.
    pub fn action(self) -> Action {
        use FailureClass::*;
        match self {
            RateLimited | Overloaded | ServerError | ReadTimeout | ConnectionReset
            | ConnectFailed | IncompleteGeneration | Protocol | CircuitOpen | ToolFailed => {
                Action::Retry
            }
            ContextExceeded => Action::RepairContext,
            MalformedOutput => Action::ReAsk,
            InvalidToolArguments => Action::ReturnToModel,
            Refusal | ContentFilter | Loop | UncertainEffect => Action::Park,
            QuotaExhausted | Auth | Permission | BadRequest | Config => Action::Terminal,
            Cancelled | DeadlineExceeded | BudgetExhausted | RetryRefused => Action::Stop,
        }
    }

    /// Whether a fresh generation with the same input may succeed.
    pub fn is_retryable(self) -> bool {
        self.action() == Action::Retry
    }

    /// Whether the failure says something about the dependency's health, so
    /// the circuit breaker should count it.
    pub fn counts_against_dependency(self) -> bool {
        use FailureClass::*;
        matches!(
            self,
            RateLimited
                | Overloaded
                | ServerError
                | ReadTimeout
                | ConnectionReset
                | ConnectFailed
                | IncompleteGeneration
                | Protocol
        )
    }

    /// The snake_case name, as in reports.
    pub fn as_str(self) -> String {
        serde_json::to_value(self)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default()
    }
}

impl std::fmt::Display for FailureClass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.as_str())
    }
}

/// The one error of `leasehold-model`.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ModelError {
    /// A non-2xx HTTP response, classified from status, code and message.
    #[error("HTTP {status} ({class}): {message}{}", hint.map(|h| format!("; {h}")).unwrap_or_default())]
    Http {
        status: u16,
        class: FailureClass,
        code: Option<String>,
        message: String,
        retry_after: Option<Duration>,
        /// What to change when the status says the configuration is wrong.
        hint: Option<&'static str>,
    },
    /// An explicit error object inside a stream (even on HTTP 200, even when
    /// `[DONE]` follows it).
    #[error("error in stream ({class}): {message}")]
    StreamError {
        class: FailureClass,
        code: Option<String>,
        message: String,
    },
    /// The stream ended before its successful terminal signal.
    #[error("incomplete generation: {0}")]
    Incomplete(String),
    #[error("read timeout waiting for {0}")]
    ReadTimeout(&'static str),
    #[error("could not connect: {0}")]
    Connect(String),
    #[error("connection reset: {0}")]
    Reset(String),
    /// Bytes that are not the protocol (bad JSON in a chunk, bad UTF-8).
    #[error("protocol error: {0}")]
    Protocol(String),
    #[error("model refused: {0}")]
    Refusal(String),
    #[error("content filter stopped the response")]
    ContentFilter,
    #[error("malformed structured output: {0}")]
    Malformed(String),
    #[error("tool {tool} failed: {message}")]
    ToolFailed { tool: String, message: String },
    #[error("tool {tool}: outcome of an external effect is uncertain: {message}")]
    UncertainEffect { tool: String, message: String },
    #[error("loop: {tool} called with the same arguments a third time ({arguments})")]
    Loop { tool: String, arguments: String },
    /// The breaker is open: `cause` is the failure that opened it.
    #[error("{cause} (circuit open for {dependency}; retry in {} ms)", retry_after.as_millis())]
    CircuitOpen {
        dependency: String,
        retry_after: Duration,
        cause: String,
    },
    #[error("cancelled")]
    Cancelled,
    #[error("deadline exceeded")]
    Deadline,
    #[error("budget exhausted: {0}")]
    Budget(BudgetKind),
    /// A retryable failure whose fresh retry the eligibility rule refused.
    #[error("retry refused ({why}) after: {cause}")]
    RetryRefused {
        why: crate::retry::Ineligible,
        cause: String,
    },
    #[error("configuration: {0}")]
    Config(String),
}

impl ModelError {
    /// The failure class: the one classifier.
    pub fn class(&self) -> FailureClass {
        match self {
            ModelError::Http { class, .. } | ModelError::StreamError { class, .. } => *class,
            ModelError::Incomplete(_) => FailureClass::IncompleteGeneration,
            ModelError::ReadTimeout(_) => FailureClass::ReadTimeout,
            ModelError::Connect(_) => FailureClass::ConnectFailed,
            ModelError::Reset(_) => FailureClass::ConnectionReset,
            ModelError::Protocol(_) => FailureClass::Protocol,
            ModelError::Refusal(_) => FailureClass::Refusal,
            ModelError::ContentFilter => FailureClass::ContentFilter,
            ModelError::Malformed(_) => FailureClass::MalformedOutput,
            ModelError::ToolFailed { .. } => FailureClass::ToolFailed,
            ModelError::UncertainEffect { .. } => FailureClass::UncertainEffect,
            ModelError::Loop { .. } => FailureClass::Loop,
            ModelError::CircuitOpen { .. } => FailureClass::CircuitOpen,
            ModelError::Cancelled => FailureClass::Cancelled,
            ModelError::Deadline => FailureClass::DeadlineExceeded,
            ModelError::Budget(_) => FailureClass::BudgetExhausted,
            ModelError::RetryRefused { .. } => FailureClass::RetryRefused,
            ModelError::Config(_) => FailureClass::Config,
        }
    }

    /// Whether a fresh generation may help.
    pub fn is_retryable(&self) -> bool {
        self.class().is_retryable()
    }

    /// A delay the server asked for (Retry-After, or a breaker's cool-down).
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            ModelError::Http { retry_after, .. } => *retry_after,
            ModelError::CircuitOpen { retry_after, .. } => Some(*retry_after),
            _ => None,
        }
    }
}

/// `{"error": {...}}` as OpenAI, vLLM, llama.cpp and others send it.
#[derive(Debug, Deserialize)]
pub(crate) struct ErrorBody {
    pub error: ErrorObject,
}

/// The error object; `code` is a string (OpenAI) or an integer (vLLM,
/// llama.cpp), so it is kept as a JSON value.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct ErrorObject {
    #[serde(default)]
    pub message: Option<String>,
    #[serde(default, rename = "type")]
    pub kind: Option<String>,
    #[serde(default)]
    pub code: Option<serde_json::Value>,
}

impl ErrorObject {
    pub(crate) fn code_string(&self) -> Option<String> {
        match &self.code {
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(serde_json::Value::Number(n)) => Some(n.to_string()),
            _ => None,
        }
    }
}

/// Classifies an error object, with the HTTP status when there is one. An
/// integer `code` inside a stream error is read as an HTTP status (vLLM).
pub(crate) fn classify(status: Option<u16>, obj: &ErrorObject) -> FailureClass {
    let code = obj.code_string().unwrap_or_default().to_ascii_lowercase();
    let kind = obj.kind.clone().unwrap_or_default().to_ascii_lowercase();
    let msg = obj.message.clone().unwrap_or_default().to_ascii_lowercase();
    let status = status.or_else(|| code.parse::<u16>().ok());
    let has = |needle: &str| code.contains(needle) || kind.contains(needle);
    if has("insufficient_quota")
        || has("billing")
        || has("spend_limit")
        || msg.contains("exceeded your current quota")
    {
        return FailureClass::QuotaExhausted;
    }
    if has("context_length") || is_context_message(&msg) {
        return FailureClass::ContextExceeded;
    }
    if has("content_filter") || has("content_policy") {
        return FailureClass::ContentFilter;
    }
    if has("overloaded") {
        return FailureClass::Overloaded;
    }
    if has("rate_limit") {
        return FailureClass::RateLimited;
    }
    // A 5xx that says the request itself is invalid (llama-cpp-python
    // answers a schema validation error with 500): the same request will
    // never be accepted.
    if status.is_some_and(|s| s >= 500) && is_invalid_request(&kind, &msg) {
        return FailureClass::BadRequest;
    }
    match status {
        Some(429) => FailureClass::RateLimited,
        Some(401) => FailureClass::Auth,
        Some(403) => FailureClass::Permission,
        Some(413) => FailureClass::ContextExceeded,
        Some(408) => FailureClass::ReadTimeout,
        Some(503) | Some(529) => FailureClass::Overloaded,
        Some(s) if s >= 500 => FailureClass::ServerError,
        Some(s) if (400..500).contains(&s) => FailureClass::BadRequest,
        // A stream error with nothing to go on: the server failed mid-way.
        _ => {
            if has("invalid_request") {
                FailureClass::BadRequest
            } else if has("auth") {
                FailureClass::Auth
            } else {
                FailureClass::ServerError
            }
        }
    }
}

/// An error body that says the request is malformed or unsupported, as
/// servers word it when they answer it with a 5xx (pydantic validation
/// errors, `invalid_request_error`).
fn is_invalid_request(kind: &str, msg: &str) -> bool {
    kind.contains("invalid_request")
        || msg.contains("validation error")
        || msg.contains("input should be")
        || msg.contains("literal_error")
        || msg.contains("invalid request")
        || msg.contains("unprocessable")
        || msg.contains("extra inputs are not permitted")
        || msg.contains("field required")
}

/// vLLM and others report context overflow only in the message text.
fn is_context_message(msg: &str) -> bool {
    msg.contains("maximum context length")
        || msg.contains("context window")
        || msg.contains("context length")
        || msg.contains("prompt is too long")
        || msg.contains("too many tokens")
        || (msg.contains("exceed") && msg.contains("context"))
}

/// The server's requested delay: `retry-after-ms`, then `Retry-After` as
/// (possibly fractional) seconds, then as an HTTP-date.
pub fn parse_retry_after(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    if let Some(ms) = headers
        .get("retry-after-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|v| v.is_finite() && *v >= 0.0)
    {
        return Some(Duration::from_secs_f64(ms / 1000.0));
    }
    let raw = headers.get("retry-after")?.to_str().ok()?.trim();
    if let Ok(secs) = raw.parse::<f64>() {
        return (secs.is_finite() && secs >= 0.0).then(|| Duration::from_secs_f64(secs));
    }
    let at = httpdate::parse_http_date(raw).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

/// The error object of a response body, in the forms servers send it:
/// `{"error": {...}}` (OpenAI, llama.cpp, Ollama), a top-level object with
/// a `message` (vLLM), FastAPI's `{"detail": ...}`, or any text.
pub(crate) fn error_object(body: &str) -> ErrorObject {
    if let Ok(b) = serde_json::from_str::<ErrorBody>(body) {
        return b.error;
    }
    if let Ok(v) = serde_json::from_str::<serde_json::Value>(body) {
        if v.get("message").is_some_and(|m| m.is_string()) {
            if let Ok(o) = serde_json::from_value::<ErrorObject>(v.clone()) {
                return o;
            }
        }
        if let Some(d) = v.get("detail") {
            return ErrorObject {
                message: Some(match d {
                    serde_json::Value::String(s) => s.clone(),
                    other => other.to_string(),
                }),
                ..Default::default()
            };
        }
    }
    ErrorObject {
        message: Some(body.chars().take(500).collect()),
        ..Default::default()
    }
}

/// What to change when a status says the endpoint or credential is wrong.
fn config_hint(status: u16) -> Option<&'static str> {
    match status {
        404 | 405 => Some("check LH_MODEL_BASE_URL: it is the base up to and including /v1 (the client posts to <base>/chat/completions), and LH_MODEL"),
        401 => Some("check LH_API_KEY"),
        403 => Some("check LH_API_KEY and the account's access to LH_MODEL"),
        _ => None,
    }
}

/// Builds the error for a non-2xx response from its status, headers and body.
pub(crate) fn http_error(status: u16, headers: &HeaderMap, body: &str) -> ModelError {
    let obj = error_object(body);
    ModelError::Http {
        status,
        class: classify(Some(status), &obj),
        code: obj.code_string().or(obj.kind.clone()),
        message: obj.message.clone().unwrap_or_default(),
        retry_after: parse_retry_after(headers, SystemTime::now()),
        hint: config_hint(status),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(code: serde_json::Value, kind: &str, msg: &str) -> ErrorObject {
        ErrorObject {
            message: Some(msg.into()),
            kind: Some(kind.into()),
            code: Some(code),
        }
    }

    #[test]
    fn classifies_provider_dialects() {
        use serde_json::json;
        assert_eq!(
            classify(
                Some(429),
                &obj(json!("insufficient_quota"), "insufficient_quota", "")
            ),
            FailureClass::QuotaExhausted
        );
        assert_eq!(
            classify(
                Some(429),
                &obj(json!("rate_limit_exceeded"), "requests", "")
            ),
            FailureClass::RateLimited
        );
        // vLLM: integer code, code-less context error in the message.
        assert_eq!(
            classify(None, &obj(json!(503), "ServiceUnavailable", "busy")),
            FailureClass::Overloaded
        );
        assert_eq!(
            classify(
                Some(400),
                &obj(
                    json!(400),
                    "BadRequestError",
                    "This model's maximum context length is 4096 tokens"
                )
            ),
            FailureClass::ContextExceeded
        );
        assert_eq!(
            classify(None, &obj(json!(null), "overloaded_error", "Overloaded")),
            FailureClass::Overloaded
        );
        assert_eq!(
            classify(Some(401), &ErrorObject::default()),
            FailureClass::Auth
        );
        assert_eq!(
            classify(Some(403), &ErrorObject::default()),
            FailureClass::Permission
        );
        assert_eq!(
            classify(Some(400), &ErrorObject::default()),
            FailureClass::BadRequest
        );
        assert_eq!(
            classify(Some(500), &ErrorObject::default()),
            FailureClass::ServerError
        );
        assert_eq!(
            classify(None, &ErrorObject::default()),
            FailureClass::ServerError
        );
    }

    #[test]
    fn a_5xx_that_says_the_request_is_invalid_is_a_bad_request() {
        let h = HeaderMap::new();
        let llama = r#"{"error":{"message":"[{'type': 'literal_error', 'loc': ('body', 'response_format', 'type'), 'msg': \"Input should be 'text' or 'json_object'\", 'input': 'json_schema'}]","type":"internal_server_error","param":null,"code":null}}"#;
        assert_eq!(http_error(500, &h, llama).class(), FailureClass::BadRequest);
        assert_eq!(
            http_error(500, &h, r#"{"error":{"message":"boom"}}"#).class(),
            FailureClass::ServerError
        );
        // vLLM's top-level error object, FastAPI's detail.
        let vllm = r#"{"object":"error","message":"This model's maximum context length is 2048 tokens. However, you requested 9000 tokens","type":"BadRequestError","param":null,"code":400}"#;
        assert_eq!(
            http_error(400, &h, vllm).class(),
            FailureClass::ContextExceeded
        );
        let e = http_error(404, &h, r#"{"detail":"Not Found"}"#);
        assert_eq!(e.class(), FailureClass::BadRequest);
        assert!(
            e.to_string().contains("Not Found") && e.to_string().contains("LH_MODEL_BASE_URL"),
            "{e}"
        );
        assert!(http_error(401, &h, "").to_string().contains("LH_API_KEY"));
        let llama_ctx = r#"{"error":{"message":"Requested tokens (9000) exceed context window of 2048","type":"invalid_request_error"}}"#;
        assert_eq!(
            http_error(400, &h, llama_ctx).class(),
            FailureClass::ContextExceeded
        );
    }

    #[test]
    fn retry_after_forms() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let mut h = HeaderMap::new();
        h.insert("retry-after", "7".parse().unwrap());
        assert_eq!(parse_retry_after(&h, now), Some(Duration::from_secs(7)));
        h.insert(
            "retry-after",
            httpdate::fmt_http_date(now + Duration::from_secs(30))
                .parse()
                .unwrap(),
        );
        assert_eq!(parse_retry_after(&h, now), Some(Duration::from_secs(30)));
        h.insert("retry-after-ms", "250".parse().unwrap());
        assert_eq!(parse_retry_after(&h, now), Some(Duration::from_millis(250)));
    }
}
