//! `leasehold-telemetry`: what an operator sees of a leasehold process.
//!
//! - [`logs`]: stderr logs, `LH_LOG_FORMAT=text|json`, `RUST_LOG`, `NO_COLOR`.
//! - [`redact_url`], [`redact_text`], [`Secret`]: credentials never reach a
//!   log line.
//! - [`metrics`] (feature `metrics`): the Prometheus plumbing (the
//!   exposition, the build info); each crate registers the families it
//!   counts on the registry its process passes in.
//! - [`observe`]: the facade through which library code (flow, model, tools,
//!   research) reports model requests, tool calls, effects and checkpoint
//!   flushes to the worker that runs it, which counts each in the family
//!   its crate registered.
//! - [`Readiness`] and [`http`] (feature `http`): `/healthz`, `/readyz`,
//!   `/metrics`.
//! - [`stop`] (feature `process`): the phased stop on SIGTERM/SIGINT
//!   every binary shares (graceful first, at once on a second signal or
//!   when the bound passes).
//! - [`trace`] (feature `otel`): opt-in OTLP/gRPC trace export, W3C
//!   `traceparent` in NATS headers and job records; [`spans`]: the job span
//!   tree with the GenAI conventions for model and tool calls.
//!
//! Features: `full` (the default) enables everything; with
//! `default-features = false` only the `tracing`-based core is built, which
//! is what library crates should depend on.

pub mod logs;
pub mod observe;
mod readiness;
mod redact;
pub mod spans;

#[cfg(feature = "http")]
pub mod http;
#[cfg(feature = "metrics")]
pub mod metrics;
#[cfg(feature = "process")]
pub mod stop;
#[cfg(feature = "otel")]
pub mod trace;

pub use readiness::Readiness;

/// The log and trace variables every binary reads (not flags), for its
/// `--help`: see [`logs`] and [`trace`].
pub const ENV_VARS: &[(&str, &str)] = &[
    ("RUST_LOG", "log filter, e.g. info or leasehold_store=debug [default: info]"),
    ("LH_LOG_FORMAT", "text or json [default: text]"),
    ("NO_COLOR", "set (non-empty): no colours in text logs"),
    (
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTLP/gRPC collector for traces (also OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) [default: none: no export]",
    ),
    ("OTEL_SERVICE_NAME", "the service name of exported spans [default: the binary's name]"),
    (
        "OTEL_*",
        "the standard OpenTelemetry variables (OTEL_RESOURCE_ATTRIBUTES, OTEL_EXPORTER_OTLP_HEADERS, OTEL_TRACES_SAMPLER, OTEL_BSP_*, OTEL_SDK_DISABLED)",
    ),
];

/// The `--help` section of [`ENV_VARS`].
pub fn env_help() -> String {
    let mut s = String::from("Logs and traces (variables, not flags):\n");
    for (name, what) in ENV_VARS {
        s.push_str(&format!("  {name:<32} {what}\n"));
    }
    s
}
pub use redact::{redact_text, redact_url, Secret, MASK};

/// Serialises this crate's tests that create spans. `tracing` caches each
/// call site's interest process-wide: a span first built on a thread with
/// no subscriber while another test installs one can be cached as "never",
/// and the other test's span is then silently disabled.
#[cfg(test)]
pub(crate) fn span_test_lock() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}
