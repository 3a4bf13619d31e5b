//! The toolbox's configuration: the built-in tools' endpoints and limits,
//! read from the environment (the variables of the module docs' table), and
//! how reads are retried.

use std::time::Duration;

use crate::builtin::fetch::FetchConfig;
use crate::builtin::publish::PublishConfig;
use crate::builtin::search::SearchConfig;
use crate::error::ToolError;
use crate::faults::Faults;

/// Every variable [`ToolboxConfig::from_env`] reads, with what it means and
/// its default (shown in `leasehold-worker --help`).
pub const ENV_VARS: &[(&str, &str)] = &[
    (
        "LH_SEARCH_URL",
        "SearxNG base URL of the search tool [default: http://127.0.0.1:8089]",
    ),
    (
        "LH_FETCH_ALLOW",
        "hosts and CIDRs fetch may reach although private or loopback, comma-separated [default: none]",
    ),
    (
        "LH_FETCH_MAX_BYTES",
        "body size limit of fetch [default: 1048576]",
    ),
    (
        "LH_FETCH_TIMEOUT",
        "time limit of one fetch, redirects included [default: 15s]",
    ),
    (
        "LH_PUBLISH_URL",
        "webhook of the publish tool, called with an Idempotency-Key [default: http://127.0.0.1:8089/effects]",
    ),
    (
        "LH_PUBLISH_DEDUPES",
        "whether the webhook deduplicates by Idempotency-Key [default: true]",
    ),
    (
        "LH_TOOL_FAULTS",
        "injected tool faults for tests, tool:mode[:count],... [default: none]",
    ),
];

/// The simulator's address, the default of every endpoint.
pub const DEFAULT_BASE_URL: &str = "http://127.0.0.1:8089";

/// How reads are retried: capped exponential backoff with full jitter,
/// bounded by attempts and by a deadline.
#[derive(Debug, Clone)]
pub struct RetryPolicy {
    /// Attempts in all, the first included (default 4).
    pub max_attempts: u32,
    /// Backoff before attempt n+1 is uniform in `[0, min(cap, base * 2^n)]`.
    pub base: Duration,
    pub cap: Duration,
    /// No retry starts after this much time since the first attempt.
    pub deadline: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 4,
            base: Duration::from_millis(200),
            cap: Duration::from_secs(5),
            deadline: Duration::from_secs(60),
        }
    }
}

impl RetryPolicy {
    pub(super) fn delay(&self, attempt: u32) -> Duration {
        use leasehold_core::retry::{capped_exponential, full_jitter};
        full_jitter(
            capped_exponential(self.base, self.cap, attempt),
            &mut rand::thread_rng(),
        )
    }
}

/// Configuration of the built-in tools. Every field has an env override (see
/// the module docs).
#[derive(Debug, Clone)]
pub struct ToolboxConfig {
    pub search: SearchConfig,
    pub fetch: FetchConfig,
    pub publish: PublishConfig,
    pub read_retry: RetryPolicy,
    /// `LH_TOOL_FAULTS` syntax; armed when the toolbox is built.
    pub faults: String,
}

impl Default for ToolboxConfig {
    fn default() -> Self {
        Self::with_base_url(DEFAULT_BASE_URL)
    }
}

impl ToolboxConfig {
    /// Every endpoint on one base URL (the simulator's), nothing allow-listed.
    pub fn with_base_url(base: &str) -> Self {
        let base = base.trim_end_matches('/');
        ToolboxConfig {
            search: SearchConfig {
                url: base.to_string(),
                ..SearchConfig::default()
            },
            fetch: FetchConfig::default(),
            publish: PublishConfig {
                url: format!("{base}/effects"),
                ..PublishConfig::default()
            },
            read_retry: RetryPolicy::default(),
            faults: String::new(),
        }
    }

    /// Defaults overridden by the environment.
    pub fn from_env() -> Result<Self, ToolError> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Like [`ToolboxConfig::from_env`] with an explicit variable source
    /// (tests). Every error names the variable.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self, ToolError> {
        let mut c = ToolboxConfig::default();
        let nonempty = |k: &str| get(k).filter(|v| !v.trim().is_empty());
        let url = |k: &str| -> Result<Option<String>, ToolError> {
            let Some(v) = nonempty(k) else {
                return Ok(None);
            };
            let v = v.trim().trim_end_matches('/').to_string();
            check_url(&v).map_err(|e| ToolError::Config(format!("{k}: `{v}` {e}")))?;
            Ok(Some(v))
        };
        if let Some(v) = url("LH_SEARCH_URL")? {
            c.search.url = v;
        }
        if let Some(v) = nonempty("LH_FETCH_ALLOW") {
            c.fetch.allow = crate::netguard::AllowList::parse(&v).map_err(ToolError::Config)?;
        }
        if let Some(v) = nonempty("LH_FETCH_MAX_BYTES") {
            c.fetch.max_bytes = v.trim().parse().map_err(|_| {
                ToolError::Config(format!("LH_FETCH_MAX_BYTES: `{v}` is not a byte count"))
            })?;
        }
        if let Some(d) = leasehold_core::time::env_duration(&get, "LH_FETCH_TIMEOUT")
            .map_err(ToolError::Config)?
        {
            if d.is_zero() {
                return Err(ToolError::Config(
                    "LH_FETCH_TIMEOUT: must be longer than 0".into(),
                ));
            }
            c.fetch.timeout = d;
        }
        if let Some(v) = url("LH_PUBLISH_URL")? {
            c.publish.url = v;
        }
        if let Some(v) = nonempty("LH_PUBLISH_DEDUPES") {
            c.publish.dedupes_by_key = match v.trim() {
                "1" | "true" | "yes" => true,
                "0" | "false" | "no" => false,
                other => {
                    return Err(ToolError::Config(format!(
                        "LH_PUBLISH_DEDUPES: `{other}` is not true/false"
                    )))
                }
            };
        }
        if let Some(v) = nonempty("LH_TOOL_FAULTS") {
            Faults::default()
                .parse_into(&v)
                .map_err(|e| ToolError::Config(format!("LH_TOOL_FAULTS: {e}")))?;
            c.faults = v;
        }
        Ok(c)
    }
}

/// An absolute `http` or `https` URL with a host.
fn check_url(v: &str) -> Result<(), String> {
    let u = url::Url::parse(v).map_err(|e| format!("is not a URL ({e})"))?;
    if !matches!(u.scheme(), "http" | "https") {
        return Err(format!("has scheme {:?}, not http or https", u.scheme()));
    }
    if u.host_str().is_none_or(str::is_empty) {
        return Err("has no host".into());
    }
    Ok(())
}
