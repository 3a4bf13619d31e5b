//! `leasehold-operate`: what operators do to jobs and how they see the
//! fleet, for the CLI, the console and the reaper alike.
//!
//! - [`actions`]: cancel, review (resume with an answer, fail), replay a
//!   dead job or a rejected submission, the `action` event each leaves;
//!   every requeue is ticket first, then record, then index
//!   (`store::work::ticket_first`), so none is lost to a crash between.
//! - [`fleet`]: the live sessions as the fleet views show them.
//!
//! `store` is the JetStream adapter these are written on; nothing here
//! holds state of its own.

pub mod actions;
pub mod fleet;

pub use actions::*;
