//! Integration tests of the tool layer: a real nats-server (JetStream KV for
//! the effects ledger) and real HTTP against the simulator's web and effects
//! routers, run in-process on a loopback socket.
//!
//! The simulator is a binary crate, so its two router modules are compiled
//! into this test binary with `#[path]`; `crate::Args` below stands in for
//! its command-line options. No test sends traffic to a non-loopback
//! address: refusals happen before connecting.

#[path = "../../../../labs/sim/src/effects.rs"]
mod effects;
#[path = "../../../../labs/sim/src/web.rs"]
mod web;

mod fetch;
mod ledger;
mod support;

/// The fields of the simulator's `Args` that its routers read.
#[derive(Debug, Clone, Default)]
pub struct Args {
    pub listen: String,
    pub seed: u64,
    pub faults: Option<std::path::PathBuf>,
}
