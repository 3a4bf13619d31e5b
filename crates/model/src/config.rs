//! Client configuration: one documented struct.
//!
//! | field | default | env |
//! |---|---|---|
//! | `base_url` | `http://127.0.0.1:8089/v1` | `LH_MODEL_BASE_URL` |
//! | `model` | `sim-1` | `LH_MODEL` |
//! | `api_key` | none | `LH_API_KEY` |
//! | `fallback_model` | none | `LH_MODEL_FALLBACK` |
//! | `connect_timeout` | 10 s | `LH_MODEL_CONNECT_TIMEOUT` (e.g. `5s`; a unit is required) |
//! | `first_byte_timeout` | 60 s | `LH_MODEL_FIRST_BYTE_TIMEOUT` |
//! | `idle_timeout` | 30 s | `LH_MODEL_IDLE_TIMEOUT` |
//! | `stream` | true | `LH_MODEL_STREAM` (`false` for non-streaming) |
//! | `structured` | auto | `LH_MODEL_STRUCTURED` (`auto`, `json_schema`, `json_object`, `prompt`) |
//! | `tools` | auto | `LH_MODEL_TOOLS` (`auto`, `native`, `text`, `none`) |
//! | `max_tokens` | none | `LH_MODEL_MAX_TOKENS` (a cap on each response, for small local models) |
//! | `concurrency` | none (learned) | `LH_MODEL_CONCURRENCY` (requests this process sends the provider at once; 1 for a server that serves one at a time) |
//!
//! `auto` adapts to the provider (see [`crate::adapt`]): it starts with the
//! richest form and moves down, once for the clients sharing its records (a worker's kind), when the provider refuses
//! a request's shape.
//!
//! The timeouts are per phase rather than one total, because a long answer
//! that keeps streaming is healthy while a silent connection is not.
//!
//! [`ModelConfig::from_env`] validates every value (durations with
//! `leasehold_time::parse_duration`, the base URL as an absolute
//! `http(s)` URL, `LH_MODEL_STREAM` as a boolean), so a worker can read it
//! once at start and refuse to run with a bad one. [`ENV_VARS`] lists the
//! variables for `--help`.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::adapt::{StructuredMode, ToolsMode};
use crate::ModelError;

/// Every variable [`ModelConfig::from_env`] reads, with what it means and
/// its default (shown in `leasehold-worker --help`).
pub const ENV_VARS: &[(&str, &str)] = &[
    (
        "LH_MODEL_BASE_URL",
        "OpenAI-compatible base URL up to and including /v1 [default: http://127.0.0.1:8089/v1]",
    ),
    (
        "LH_MODEL",
        "model name sent in each request [default: sim-1]",
    ),
    (
        "LH_API_KEY",
        "bearer token of the model server (from a secret) [default: none]",
    ),
    (
        "LH_MODEL_FALLBACK",
        "model used once the primary's retries are spent [default: none]",
    ),
    (
        "LH_MODEL_CONNECT_TIMEOUT",
        "TCP and TLS connect timeout [default: 10s]",
    ),
    (
        "LH_MODEL_FIRST_BYTE_TIMEOUT",
        "until the first response bytes [default: 60s]",
    ),
    (
        "LH_MODEL_IDLE_TIMEOUT",
        "longest silence while streaming [default: 30s]",
    ),
    (
        "LH_MODEL_STREAM",
        "true for SSE streaming, false for one JSON response [default: true]",
    ),
    (
        "LH_MODEL_STRUCTURED",
        "structured output form: auto, json_schema, json_object (with a schema), prompt [default: auto]",
    ),
    (
        "LH_MODEL_MAX_TOKENS",
        "cap on the tokens of each response (max_tokens), e.g. for a small local model [default: none]",
    ),
    (
        "LH_MODEL_TOOLS",
        "tool calling: auto, native, text (a text protocol), none [default: auto]",
    ),
    (
        "LH_MODEL_CONCURRENCY",
        "requests sent to the model server at once (1 for a server that serves one at a time, e.g. llama-cpp-python); a limit set with `leasehold limits set --concurrency` wins [default: none; a server seen cutting streams for another request is learned to take 1]",
    ),
];

/// Per-provider behaviour that is not an error.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Quirks {
    /// Require `data: [DONE]` after the finish signal. Off by default: some
    /// servers close the stream cleanly after `finish_reason` without it, and
    /// `[DONE]` alone never proves success anyway.
    #[serde(default)]
    pub require_done: bool,
    /// Do not send `stream_options.include_usage` (older servers reject it).
    #[serde(default)]
    pub no_stream_options: bool,
}

/// Where and how to reach the model. `Debug` never shows the API key.
#[derive(Clone, Serialize, Deserialize)]
pub struct ModelConfig {
    /// Base URL up to and including `/v1`.
    pub base_url: String,
    /// Model name sent in each request.
    pub model: String,
    /// Bearer token; omitted from requests when `None`.
    #[serde(skip_serializing)]
    pub api_key: Option<String>,
    /// Used only when the primary has failed with a retryable class and the
    /// generation retries are spent; its use is recorded in a retry report.
    pub fallback_model: Option<String>,
    #[serde(with = "humantime_serde_dur")]
    pub connect_timeout: Duration,
    /// Until the response headers and the first body bytes arrive.
    #[serde(with = "humantime_serde_dur")]
    pub first_byte_timeout: Duration,
    /// Longest silence between body chunks once streaming.
    #[serde(with = "humantime_serde_dur")]
    pub idle_timeout: Duration,
    /// Streaming (SSE) or one JSON response.
    pub stream: bool,
    pub quirks: Quirks,
    /// How structured output is asked for.
    #[serde(default = "auto_structured")]
    pub structured: StructuredMode,
    /// How tools are offered.
    #[serde(default = "auto_tools")]
    pub tools: ToolsMode,
    /// `max_tokens` of every request that sets none.
    #[serde(default)]
    pub max_tokens: Option<u32>,
    /// Requests this process sends the provider at once (`None`: as many
    /// as asked, or what flow control learned or the fleet set; see
    /// [`leasehold_flow`]).
    #[serde(default)]
    pub concurrency: Option<u64>,
}

fn auto_structured() -> StructuredMode {
    StructuredMode::Auto
}

fn auto_tools() -> ToolsMode {
    ToolsMode::Auto
}

impl std::fmt::Debug for ModelConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Spelled out rather than derived: a derived Debug printed the key
        // wherever a config was logged with `?`.
        let ModelConfig {
            base_url,
            model,
            api_key,
            fallback_model,
            connect_timeout,
            first_byte_timeout,
            idle_timeout,
            stream,
            quirks,
            structured,
            tools,
            max_tokens,
            concurrency,
        } = self;
        f.debug_struct("ModelConfig")
            .field("base_url", base_url)
            .field("model", model)
            .field("api_key", &api_key.as_ref().map(|_| "***"))
            .field("fallback_model", fallback_model)
            .field("connect_timeout", connect_timeout)
            .field("first_byte_timeout", first_byte_timeout)
            .field("idle_timeout", idle_timeout)
            .field("stream", stream)
            .field("quirks", quirks)
            .field("structured", structured)
            .field("tools", tools)
            .field("max_tokens", max_tokens)
            .field("concurrency", concurrency)
            .finish()
    }
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            base_url: "http://127.0.0.1:8089/v1".into(),
            model: "sim-1".into(),
            api_key: None,
            fallback_model: None,
            connect_timeout: Duration::from_secs(10),
            first_byte_timeout: Duration::from_secs(60),
            idle_timeout: Duration::from_secs(30),
            stream: true,
            quirks: Quirks::default(),
            structured: StructuredMode::Auto,
            tools: ToolsMode::Auto,
            max_tokens: None,
            concurrency: None,
        }
    }
}

impl ModelConfig {
    /// Defaults overridden by the `LH_MODEL_*` / `LH_API_KEY` variables.
    pub fn from_env() -> Result<Self, ModelError> {
        Self::from_lookup(&|k| std::env::var(k).ok())
    }

    /// Like [`ModelConfig::from_env`] with an explicit variable source
    /// (tests). Every error names the variable and its value.
    pub fn from_lookup(get: &dyn Fn(&str) -> Option<String>) -> Result<Self, ModelError> {
        let mut c = ModelConfig::default();
        let var = |k: &str| {
            get(k)
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
        };
        if let Some(v) = var("LH_MODEL_BASE_URL") {
            check_base_url(&v)
                .map_err(|e| ModelError::Config(format!("LH_MODEL_BASE_URL={v}: {e}")))?;
            c.base_url = v;
        }
        if let Some(v) = var("LH_MODEL") {
            c.model = v;
        }
        c.api_key = var("LH_API_KEY");
        c.fallback_model = var("LH_MODEL_FALLBACK");
        for (k, d) in [
            ("LH_MODEL_CONNECT_TIMEOUT", &mut c.connect_timeout),
            ("LH_MODEL_FIRST_BYTE_TIMEOUT", &mut c.first_byte_timeout),
            ("LH_MODEL_IDLE_TIMEOUT", &mut c.idle_timeout),
        ] {
            if let Some(v) = leasehold_time::env_duration(get, k).map_err(ModelError::Config)? {
                if v.is_zero() {
                    return Err(ModelError::Config(format!("{k}: must be longer than 0")));
                }
                *d = v;
            }
        }
        if let Some(v) = var("LH_MODEL_STREAM") {
            c.stream = match v.to_ascii_lowercase().as_str() {
                "1" | "true" | "yes" | "on" => true,
                "0" | "false" | "no" | "off" => false,
                _ => {
                    return Err(ModelError::Config(format!(
                        "LH_MODEL_STREAM={v}: expected true or false"
                    )))
                }
            };
        }
        if let Some(v) = var("LH_MODEL_STRUCTURED") {
            c.structured = StructuredMode::parse(&v)
                .map_err(|e| ModelError::Config(format!("LH_MODEL_STRUCTURED={e}")))?;
        }
        if let Some(v) = var("LH_MODEL_MAX_TOKENS") {
            c.max_tokens = Some(v.parse::<u32>().ok().filter(|n| *n > 0).ok_or_else(|| {
                ModelError::Config(format!(
                    "LH_MODEL_MAX_TOKENS={v}: expected a whole number of tokens above 0"
                ))
            })?);
        }
        if let Some(v) = var("LH_MODEL_TOOLS") {
            c.tools = ToolsMode::parse(&v)
                .map_err(|e| ModelError::Config(format!("LH_MODEL_TOOLS={e}")))?;
        }
        if let Some(v) = var("LH_MODEL_CONCURRENCY") {
            c.concurrency = Some(
                v.parse::<u64>()
                    .ok()
                    .filter(|n| (1..=1_000_000).contains(n))
                    .ok_or_else(|| {
                        ModelError::Config(format!(
                            "LH_MODEL_CONCURRENCY={v}: expected a whole number of requests at once, 1 to 1000000 (1 for a server that serves one request at a time)"
                        ))
                    })?,
            );
        }
        Ok(c)
    }

    /// The chat completions endpoint.
    pub fn chat_url(&self) -> String {
        format!("{}/chat/completions", self.base_url.trim_end_matches('/'))
    }
}

/// An absolute `http` or `https` URL with a host, as the client will join
/// `/chat/completions` to it.
fn check_base_url(v: &str) -> Result<(), String> {
    let u = reqwest::Url::parse(v).map_err(|e| format!("not a URL ({e})"))?;
    if !matches!(u.scheme(), "http" | "https") {
        return Err(format!("scheme {:?} is not http or https", u.scheme()));
    }
    if u.host_str().is_none_or(str::is_empty) {
        return Err("no host".into());
    }
    if u.query().is_some() || u.fragment().is_some() {
        return Err("a base URL takes no query or fragment".into());
    }
    Ok(())
}

/// Durations as strings ("10s") in JSON, for readable configs.
mod humantime_serde_dur {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&humantime::format_duration(*d).to_string())
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let s = String::deserialize(d)?;
        leasehold_time::parse_duration(&s).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn lookup(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn reads_and_validates_every_variable() {
        let c = ModelConfig::from_lookup(&lookup(&[
            ("LH_MODEL_BASE_URL", " https://models.example/v1 "),
            ("LH_MODEL", "m"),
            ("LH_API_KEY", "k"),
            ("LH_MODEL_IDLE_TIMEOUT", "45s"),
            ("LH_MODEL_CONNECT_TIMEOUT", "500ms"),
            ("LH_MODEL_STREAM", "false"),
            ("LH_MODEL_STRUCTURED", "json_object"),
            ("LH_MODEL_TOOLS", "text"),
            ("LH_MODEL_MAX_TOKENS", "256"),
            ("LH_MODEL_CONCURRENCY", " 1 "),
        ]))
        .unwrap();
        assert_eq!(c.base_url, "https://models.example/v1");
        assert_eq!((c.model.as_str(), c.api_key.as_deref()), ("m", Some("k")));
        assert_eq!(c.idle_timeout, Duration::from_secs(45));
        assert_eq!(c.connect_timeout, Duration::from_millis(500));
        assert!(!c.stream);
        assert_eq!(c.structured, StructuredMode::JsonObject);
        assert_eq!(c.tools, ToolsMode::Text);
        assert_eq!(c.max_tokens, Some(256));
        assert_eq!(c.concurrency, Some(1));
        let d = ModelConfig::from_lookup(&|_| None).unwrap();
        assert_eq!(d.base_url, ModelConfig::default().base_url);

        for (k, v) in [
            ("LH_MODEL_BASE_URL", "127.0.0.1:8089/v1"),
            ("LH_MODEL_BASE_URL", "ftp://host/v1"),
            ("LH_MODEL_BASE_URL", "http://"),
            ("LH_MODEL_BASE_URL", "not a url"),
            ("LH_MODEL_IDLE_TIMEOUT", "30"),
            ("LH_MODEL_FIRST_BYTE_TIMEOUT", "soon"),
            ("LH_MODEL_CONNECT_TIMEOUT", "0s"),
            ("LH_MODEL_STREAM", "flase"),
            ("LH_MODEL_STRUCTURED", "json"),
            ("LH_MODEL_STRUCTURED", "json-schema"),
            ("LH_MODEL_TOOLS", "yes"),
            ("LH_MODEL_MAX_TOKENS", "0"),
            ("LH_MODEL_MAX_TOKENS", "lots"),
            ("LH_MODEL_CONCURRENCY", "0"),
            ("LH_MODEL_CONCURRENCY", "-1"),
            ("LH_MODEL_CONCURRENCY", "two"),
            ("LH_MODEL_CONCURRENCY", "1.5"),
        ] {
            let e = ModelConfig::from_lookup(&lookup(&[(k, v)])).unwrap_err();
            assert!(e.to_string().contains(k), "{k}={v}: {e}");
        }
    }

    #[test]
    fn every_variable_read_is_listed() {
        let read = std::sync::Mutex::new(Vec::new());
        ModelConfig::from_lookup(&|k| {
            read.lock().unwrap().push(k.to_string());
            None
        })
        .unwrap();
        for k in read.into_inner().unwrap() {
            assert!(
                ENV_VARS.iter().any(|(n, _)| *n == k),
                "{k} is not in ENV_VARS"
            );
        }
    }

    #[test]
    fn debug_never_shows_the_api_key() {
        let c = ModelConfig {
            api_key: Some("sk-live-0123456789".into()),
            ..ModelConfig::default()
        };
        let shown = format!("{c:?} {c:#?}");
        assert!(!shown.contains("sk-live"), "{shown}");
        assert!(shown.contains(r#"api_key: Some("***")"#), "{shown}");
        assert!(shown.contains("sim-1"), "the rest is still there: {shown}");
        let none = format!("{:?}", ModelConfig::default());
        assert!(none.contains("api_key: None"), "{none}");
        // Nor does the JSON form (a config dump) carry it.
        let json = serde_json::to_string(&c).expect("json");
        assert!(!json.contains("sk-live"), "{json}");
    }
}
