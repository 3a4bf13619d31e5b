//! `leasehold-agent`: the agent loop, between the model and the tools.
//!
//! - [`SectionRunner`] (module [`runner`]): one section's tool loop with
//!   generation, warm and cold retries, budgets and the loop guard; research's
//!   sections and the SDK's `ctx.agent` run through it.
//! - [`AgentTools`]: a toolbox offered to the runner as its
//!   [`ToolExecutor`], each call keyed, guarded and recorded by the tools
//!   crate.
//!
//! The model crate is the client, its wire types, provider adaptation,
//! retry and breaker; the tools crate is the toolbox and the effects
//! ledger. Neither knows the other: this crate adapts one to the other.

pub mod runner;
mod tools;

pub use runner::*;
pub use tools::AgentTools;
