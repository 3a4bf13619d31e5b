//! `leasehold-telemetry`: what an operator sees of a leasehold process.
//!
//! - [`logs`]: stderr logs, `LH_LOG_FORMAT=text|json`, `RUST_LOG`, `NO_COLOR`.
//! - [`redact_url`], [`Secret`]: credentials never reach a log line.
//! - [`Readiness`]: what `/readyz` will answer, flipped by the services.

pub mod logs;
mod readiness;
mod redact;

pub use readiness::Readiness;
pub use redact::{redact_url, Secret, MASK};
