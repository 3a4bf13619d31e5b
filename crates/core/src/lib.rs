//! Pure job logic of leasehold: no I/O, no NATS, no clocks of its own (every
//! function that needs "now" takes it as an argument).
//!
//! - [`status`]: the job statuses.
//! - [`machine`]: the job state machine: claim decisions and every transition
//!   as a pure function on a [`JobRecord`], owner-checked where the contract
//!   says so.
//! - [`spec`]: decoding and validating submissions (JSON or protobuf).
//! - [`lane`]: tenants and priorities: the lane a job waits in, and which lane goes next.
//! - [`retry`]: job-level retry policy (capped exponential backoff, full jitter).
//! - [`schedule`]: recurring schedules: cron expressions and which tick fires.
//! - [`shard`]: how reapers split the work (a stable hash of the job id).
//! - [`time`]: RFC 3339 timestamps and human durations (`500ms`, `3s`, `2m`):
//!   the `leasehold-time` crate, re-exported.
//!
//! Architecture invariant: `cargo tree -p leasehold-core -i async-nats` finds nothing;
//! it depends on `proto` and `time` alone, both pure.

pub mod lane;
pub mod machine;
pub mod retry;
pub mod schedule;
pub mod shard;
pub mod spec;
pub mod status;
pub use leasehold_time as time;

pub use leasehold_proto::{JobError, JobRecord, JobSpec};
pub use machine::{ClaimDecision, End, Owner, TransitionError};
pub use status::Status;
