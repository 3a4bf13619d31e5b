//! The stateless leasehold worker.
//!
//! - [`config`]: [`Options`], every flag with its `LH_<FLAG>` variable.
//! - [`handler`]: the [`Handler`] an attempt runs through (the SDK gives
//!   one per kind, the built-in kinds included) and the [`End`] it returns.
//! - [`service`]: [`Worker::run`]: pull loops bounded by free slots, claims,
//!   the per-job runner (heartbeat, progress acks, owner-checked outcome) and
//!   the three-phase shutdown.
//! - [`gateway`]: answers what no stream holds: submissions of unknown
//!   kinds, error replies to request/reply submitters, and `lh.cancel.<id>`.

pub mod checkpoint;
pub mod config;
pub mod flow;
pub mod gateway;
pub mod handler;
pub mod metrics;
pub mod process;
pub mod service;

pub use config::Options;
pub use handler::{Handler, JobCtx};
pub use leasehold_core::End;
pub use service::{Handle, NotHandedBack, Worker};
