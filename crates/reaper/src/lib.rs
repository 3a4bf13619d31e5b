//! The leasehold reaper: what keeps a fleet healthy when jobs, not workers,
//! are the problem.
//!
//! - Poison jobs: a running job whose lease expired after `--max-stale-reclaims`
//!   stale reclaims (the workers refuse to reclaim it further) becomes `dead`
//!   with class `poison`; its ticket is deleted and a dead letter with its
//!   last record and recent events goes to `lh.dlq.<kind>`.
//! - Max deliveries: the server's advisories, captured durably by the
//!   `LH_ADVISORIES` stream, are consumed by a durable consumer shared by
//!   every replica; the ticket is loaded by sequence, its job becomes `dead`
//!   with class `max_deliveries`, and the ticket is deleted.
//! - Stranded runs: a running job past its lease by `--stranded-grace`, or a
//!   queued job untouched for as long, whose ticket is gone gets a fresh
//!   deduplicated ticket (a recovery, counted and announced by a `progress`
//!   event with `"recovered": true`).
//! - Metrics: [`Metrics`] per sweep, logged, on the [`Handle`], and served on
//!   `<prefix>.reaper.metrics`.
//!
//! Modules: [`config`] ([`Options`]), [`decide`] (pure decisions per
//! record), [`metrics`], [`service`] ([`Reaper::start`] and the tasks).
//!
//! Architecture invariant: every action is a revision-conditioned write or
//! a deduplicated publish, so two or more replicas are safe at once.

pub mod config;
pub mod decide;
pub mod metrics;
pub mod service;

pub use config::Options;
pub use metrics::Metrics;
pub use service::{Handle, Reaper, ReaperError, Stats};
