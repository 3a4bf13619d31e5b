//! The tests' fleet, above the engine: what `tests/` needs to run leasehold
//! and break it on purpose, named once.
//!
//! The floor-0 harness (`leasehold-harness`) starts servers and processes
//! and injects network faults; it knows nothing of leasehold's layout. This
//! crate stands on the engine and gives the integration tests one API:
//!
//! - [`Fleet`]: a real `nats-server` with the layout made
//!   ([`Fleet::start`], [`Fleet::with`]); workers in-process
//!   ([`Fleet::worker`]) or as processes ([`Fleet::worker_proc`]); reapers
//!   ([`Fleet::reaper`]); submissions ([`Fleet::submit`]); records read,
//!   seeded and awaited ([`Fleet::record`], [`Fleet::seed_record`],
//!   [`Fleet::wait_for`], [`Fleet::wait_status`], [`Fleet::wait_event`]).
//! - [`record`]: the job record, its spec and events as the bucket and the
//!   stream hold them, and the clock format they are written in, for a
//!   test that makes up a record.
//! - [`doors`]: the engine's protocol types a fault test opens on purpose
//!   (a stale owner's gate, a fence, the active index, the ledger, the flow
//!   store), grouped by what they break.
//!
//! `tests/` depends on this crate, the harness and the public crates (the
//! SDK `leasehold`, the protocol `leasehold-proto`) and on no engine crate:
//! a renamed engine type changes this crate, not thirty test files.

pub mod doors;
mod fleet;
pub mod record;

pub use fleet::*;
pub use leasehold_store::setup::SetupOptions;
