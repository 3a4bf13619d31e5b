//! The stateless leasehold worker.
//!
//! - [`config`]: [`Options`], every flag with its `LH_<FLAG>` variable.
//! - [`handler`]: the [`Handler`] trait workflows implement, and the
//!   built-in kinds `echo`, `sleep`, `fail`, `crash`.
//! - [`service`]: [`Worker::run`]: pull loops bounded by free slots, claims,
//!   the per-job runner (heartbeat, progress acks, owner-checked outcome) and
//!   the three-phase shutdown.
//! - [`gateway`]: answers what no stream holds: submissions of unknown
//!   kinds, error replies to request/reply submitters, and `lh.cancel.<id>`.

pub mod checkpoint;
pub mod config;
pub mod deliver;
pub mod flow;
pub mod gateway;
pub mod handler;
pub mod process;
pub mod service;

pub use config::Options;
pub use handler::{Handler, HandlerError, JobCtx, Outcome};
pub use service::{Handle, NotHandedBack, Worker};
