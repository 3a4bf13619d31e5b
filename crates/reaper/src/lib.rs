//! The leasehold reaper: what keeps a fleet healthy when processes die and
//! jobs, not workers, are the problem. Recovery itself needs no reaper
//! (workers handle ended sessions too); the reaper makes it fast and
//! finishes what nobody else does.
//!
//! - Crashes, fast: every live worker session is pinged; a closed
//!   connection ("no responders") ends the session at once, and its jobs
//!   are re-offered within about a second instead of after the timeout.
//! - Ended sessions: like every worker, a member of the durable consumer of
//!   session ends (`leasehold_store::recovery`).
//! - The sweep over the index of active jobs: running jobs of ended
//!   sessions and hung attempts (past their deadline) re-offered; waiting
//!   jobs whose ticket is gone or stuck given a fresh one; index entries
//!   that disagree with their record repaired; poison jobs dead-lettered.
//! - Retention: finished jobs are removed after `--retention` (per kind:
//!   `--retention-kind`), events first, the record last ([`retention`]).
//! - Recurring schedules: each tick fired at its time, exactly once across
//!   replicas, missed ticks within a bounded catch-up (`schedules.rs`).
//! - Due-time wake-ups: waiting jobs whose ticket was released for their
//!   wait get a fresh one at their time (`leasehold_store::timers`, which
//!   every worker runs too).
//! - Max deliveries: the server's advisories, captured durably by the
//!   `LH_ADVISORIES` stream; a live job is never killed for them.
//! - History: one entry per finished job in `LH_HISTORY`, from the
//!   terminal events (`historian.rs`), for `leasehold list --finished`
//!   and the console's search.
//! - Metrics: [`Metrics`] per sweep, logged, on the [`Handle`], and served on
//!   `<prefix>.reaper.metrics`.
//!
//! Modules: [`config`] ([`Options`]), [`decide`] (pure decisions per index
//! entry), [`metrics`], [`service`] ([`Reaper::start`] and the tasks).
//!
//! Architecture invariant: every action is a revision-conditioned write or
//! a deduplicated publish, so two or more replicas are safe at once.

pub mod config;
pub mod decide;
pub mod historian;
pub mod metrics;
pub mod retention;
mod schedules;
pub mod service;

pub use config::Options;
pub use metrics::{FleetSnapshot, Metrics, ReaperMetrics, Stats};
pub use service::{Handle, Reaper, ReaperError};
