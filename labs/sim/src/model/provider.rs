//! How each OpenAI-compatible server the sim imitates differs from OpenAI:
//! which structured outputs and tools it takes, and the shapes of its errors
//! (format in the parent module's docs).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

/// The server the sim answers as (`--provider`, env `LH_SIM_PROVIDER`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Provider {
    /// OpenAI itself (the default).
    #[default]
    Openai,
    /// llama-cpp-python's server.
    LlamaCpp,
    /// vLLM's OpenAI-compatible server.
    Vllm,
    /// Ollama's OpenAI-compatible endpoint.
    Ollama,
}

impl Provider {
    pub fn name(self) -> &'static str {
        match self {
            Provider::Openai => "openai",
            Provider::LlamaCpp => "llama-cpp",
            Provider::Vllm => "vllm",
            Provider::Ollama => "ollama",
        }
    }

    /// Whether `response_format: {"type": "json_schema"}` is accepted.
    pub fn takes_json_schema(self) -> bool {
        self != Provider::LlamaCpp
    }

    /// Whether native `tools` are honoured (otherwise they are ignored).
    pub fn takes_tools(self) -> bool {
        self != Provider::LlamaCpp
    }

    /// Whether `{"type": "json_object", "schema": {...}}` is held to the schema.
    pub fn json_object_schema(self) -> bool {
        self == Provider::LlamaCpp
    }

    /// Whether a streamed tool call arrives whole in one chunk.
    pub fn whole_tool_calls(self) -> bool {
        self == Provider::Ollama
    }

    /// Whether `stream_options.include_usage` gets a usage chunk.
    pub fn usage_chunk(self) -> bool {
        self != Provider::Ollama
    }

    /// Whether a prompt over the context is refused (otherwise truncated).
    pub fn refuses_overflow(self) -> bool {
        self != Provider::Ollama
    }

    /// A request this server cannot parse or validate; `detail` says why
    /// (OpenAI, vLLM and Ollama say it in the message, llama-cpp-python
    /// answers with pydantic's error list instead).
    pub fn bad_request(self, problem: Problem, detail: &str) -> Response {
        let message = match problem {
            Problem::InvalidJson => format!("invalid JSON body: {detail}"),
            Problem::MissingMessages => "messages is required".to_string(),
        };
        match self {
            Provider::Openai => openai_error(
                StatusCode::BAD_REQUEST,
                &message,
                "invalid_request_error",
                json!(match problem {
                    Problem::InvalidJson => "invalid_json",
                    Problem::MissingMessages => "missing_messages",
                }),
            ),
            Provider::LlamaCpp => match problem {
                Problem::InvalidJson => llama_validation(
                    "('body', 0)",
                    "json_invalid",
                    "JSON decode error",
                    &format!("{{}}, 'ctx': {{'error': {}}}", py_str(detail)),
                ),
                Problem::MissingMessages => {
                    llama_validation("('body', 'messages')", "missing", "Field required", "{}")
                }
            },
            Provider::Vllm => vllm_error(&message),
            Provider::Ollama => openai_error(
                StatusCode::BAD_REQUEST,
                &message,
                "invalid_request_error",
                Value::Null,
            ),
        }
    }

    /// The context-length refusal: `chars` of messages over a window of
    /// `limit` characters (tokens are characters / 4, as in `usage`).
    pub fn context_exceeded(self, chars: usize, limit: Option<usize>) -> Response {
        let asked = chars.div_ceil(4);
        let window = limit.map_or(asked.saturating_sub(1), |l| l / 4);
        match self {
            Provider::Openai => openai_error(
                StatusCode::BAD_REQUEST,
                &format!("This model's maximum context length is exceeded: the request has {chars} characters (simulated)"),
                "invalid_request_error",
                json!("context_length_exceeded"),
            ),
            // llama-cpp-python turns llama.cpp's "Requested tokens (N) exceed
            // context window of M" into this OpenAI-style 400.
            Provider::LlamaCpp => (
                StatusCode::BAD_REQUEST,
                Json(json!({"error": {
                    "message": format!("This model's maximum context length is {window} tokens. However, you requested {asked} tokens ({asked} in the messages, None in the completion). Please reduce the length of the messages or completion."),
                    "type": "invalid_request_error",
                    "param": "messages",
                    "code": "context_length_exceeded",
                }})),
            )
                .into_response(),
            Provider::Vllm => vllm_error(&format!(
                "This model's maximum context length is {window} tokens. However, you requested {asked} tokens ({asked} in the messages, 0 in the completion). Please reduce the length of the messages or completion."
            )),
            // Ollama truncates instead; only a fault gets here.
            Provider::Ollama => openai_error(
                StatusCode::BAD_REQUEST,
                &format!("the input length ({asked} tokens) exceeds the context length ({window} tokens) (simulated)"),
                "invalid_request_error",
                Value::Null,
            ),
        }
    }

    /// What an unknown path answers.
    pub fn not_found(self, method: &str, path: &str) -> Response {
        match self {
            Provider::Openai => openai_error(
                StatusCode::NOT_FOUND,
                &format!("Invalid URL ({method} {path})"),
                "invalid_request_error",
                Value::Null,
            ),
            Provider::LlamaCpp | Provider::Vllm => not_found_detail(),
            Provider::Ollama => (
                StatusCode::NOT_FOUND,
                [("content-type", "text/plain")],
                "404 page not found",
            )
                .into_response(),
        }
    }
}

/// `{"error": {"message", "type", "param": null, "code"}}` with `status`.
pub fn openai_error(status: StatusCode, message: &str, kind: &str, code: Value) -> Response {
    (
        status,
        Json(json!({"error": {"message": message, "type": kind, "param": null, "code": code}})),
    )
        .into_response()
}

/// vLLM's error: a top-level object, HTTP 400.
fn vllm_error(message: &str) -> Response {
    (
        StatusCode::BAD_REQUEST,
        Json(json!({"object": "error", "message": message, "type": "BadRequestError", "param": null, "code": 400})),
    )
        .into_response()
}

/// FastAPI's 404: `{"detail": "Not Found"}`.
pub fn not_found_detail() -> Response {
    (StatusCode::NOT_FOUND, Json(json!({"detail": "Not Found"}))).into_response()
}

/// llama-cpp-python's answer to a request that fails validation: HTTP 500
/// whose message is the repr of pydantic's error list.
pub fn llama_validation(loc: &str, kind: &str, msg: &str, input: &str) -> Response {
    let message = format!(
        "[{{'type': '{kind}', 'loc': {loc}, 'msg': {}, 'input': {input}}}]",
        py_str(msg)
    );
    (
        StatusCode::INTERNAL_SERVER_ERROR,
        Json(json!({"error": {"message": message, "type": "internal_server_error", "param": null, "code": null}})),
    )
        .into_response()
}

/// The refusal of `response_format.type` = `json_schema` by llama-cpp-python.
pub fn llama_json_schema_refusal() -> Response {
    llama_validation(
        "('body', 'response_format', 'type')",
        "literal_error",
        "Input should be 'text' or 'json_object'",
        "'json_schema'",
    )
}

/// A Python `repr` of a string: single quotes unless it holds one.
pub fn py_str(s: &str) -> String {
    if s.contains('\'') && !s.contains('"') {
        format!("\"{s}\"")
    } else {
        format!("'{}'", s.replace('\'', "\\'"))
    }
}

/// What is wrong with a request the sim cannot serve.
#[derive(Debug, Clone, Copy)]
pub enum Problem {
    /// The body is not JSON.
    InvalidJson,
    /// The body has no `messages` array.
    MissingMessages,
}
