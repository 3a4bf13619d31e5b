//! Client configuration: one documented struct.
//!
//! | field | default | env |
//! |---|---|---|
//! | `base_url` | `http://127.0.0.1:8089/v1` | `LH_MODEL_BASE_URL` |
//! | `model` | `sim-1` | `LH_MODEL` |
//! | `api_key` | none | `LH_API_KEY` |
//! | `fallback_model` | none | `LH_MODEL_FALLBACK` |
//! | `connect_timeout` | 10 s | `LH_MODEL_CONNECT_TIMEOUT` (humantime, e.g. `5s`) |
//! | `first_byte_timeout` | 60 s | `LH_MODEL_FIRST_BYTE_TIMEOUT` |
//! | `idle_timeout` | 30 s | `LH_MODEL_IDLE_TIMEOUT` |
//! | `stream` | true | `LH_MODEL_STREAM` (`false` for non-streaming) |
//!
//! The timeouts are per phase rather than one total, because a long answer
//! that keeps streaming is healthy while a silent connection is not.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::ModelError;

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
        }
    }
}

impl ModelConfig {
    /// Defaults overridden by the `LH_MODEL_*` / `LH_API_KEY` variables.
    pub fn from_env() -> Result<Self, ModelError> {
        let mut c = ModelConfig::default();
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        if let Some(v) = var("LH_MODEL_BASE_URL") {
            c.base_url = v;
        }
        if let Some(v) = var("LH_MODEL") {
            c.model = v;
        }
        c.api_key = var("LH_API_KEY");
        c.fallback_model = var("LH_MODEL_FALLBACK");
        let dur = |k: &str, d: &mut Duration| -> Result<(), ModelError> {
            if let Some(v) = var(k) {
                *d = humantime::parse_duration(&v)
                    .map_err(|e| ModelError::Config(format!("{k}={v}: {e}")))?;
            }
            Ok(())
        };
        dur("LH_MODEL_CONNECT_TIMEOUT", &mut c.connect_timeout)?;
        dur("LH_MODEL_FIRST_BYTE_TIMEOUT", &mut c.first_byte_timeout)?;
        dur("LH_MODEL_IDLE_TIMEOUT", &mut c.idle_timeout)?;
        if let Some(v) = var("LH_MODEL_STREAM") {
            c.stream = !matches!(v.as_str(), "0" | "false" | "no");
        }
        Ok(c)
    }

    /// The chat completions endpoint.
    pub fn chat_url(&self) -> String {
        format!("{}/chat/completions", self.base_url.trim_end_matches('/'))
    }
}

/// Durations as humantime strings ("10s") in JSON, for readable configs.
mod humantime_serde_dur {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&humantime::format_duration(*d).to_string())
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let s = String::deserialize(d)?;
        humantime::parse_duration(&s).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
