//! Tools and side effects: the layer between an agent's tool calls and the
//! outside world.
//!
//! A [`Tool`] declares its name, the JSON Schema of its arguments, its
//! [`ToolKind`] (read, write, hosted) and its timeout; writes may also declare
//! a business key and a `find_existing` reconciliation. The [`Toolbox`] runs
//! every call the same way, for workers and for `leasehold tool call`:
//!
//! 1. arguments are validated against the schema; an invalid call is an
//!    [`ToolError::InvalidArgs`] whose [`ToolError::disposition`] says "give
//!    this back to the model", never a crash;
//! 2. a write's idempotency key is derived from (job id, step id, tool name)
//!    by [`idempotency_key`], never from the arguments: one step makes one
//!    effect however its model words the call; the digest of the canonical
//!    arguments ([`arg_digest`]) is stored beside the key; a read's key
//!    ([`read_key`]) also hashes the arguments and only labels its events;
//! 3. reads run with capped exponential backoff and full jitter (this is the
//!    single retry layer for tools) and return their result so the caller can
//!    record it with the step;
//! 4. writes go through the effects ledger ([`EffectsLedger`], KV bucket
//!    `lh_effects`): `in_flight` is created if absent before the effect,
//!    `done` with the result after it; a `done` key replays, an `in_flight`
//!    key is reconciled (found → done; not found and the destination dedupes
//!    by key → run again with the same key; destination unreachable for the
//!    lookup → [`ToolError::Unreachable`], retry later with the key still in
//!    flight; otherwise fail closed with [`ToolError::UncertainEffect`], which
//!    parks the job); an executor whose epoch is older than the one holding
//!    an `in_flight` key gets [`ToolError::Superseded`]; the same key with
//!    other arguments (another digest) is [`ToolError::KeyReuse`], refused
//!    and never sent, which parks the job; a business key already
//!    delivered by another step replays that step's result; right before
//!    the effect runs, the call's [`EffectGuard`] (a worker's
//!    [`OwnerGuard`]: a fenced write of the job's record) proves the caller
//!    still owns the job, and a refusal ([`ToolError::OwnershipLost`],
//!    [`Disposition::Stop`]) stops the call with nothing sent;
//! 5. every step of that is reported as a [`ToolEvent`] to a [`ToolEvents`]
//!    sink, which the workflow publishes as `tool` events.
//!
//! Fault injection ([`Faults::fail_next`]) sits inside the layer, around the
//! tool's own execution, so tests, the demo and the chaos suite exercise the
//! real ledger logic.
//!
//! Configuration ([`ToolboxConfig::from_env`]): `LH_SEARCH_URL`,
//! `LH_FETCH_ALLOW`, `LH_FETCH_MAX_BYTES`, `LH_FETCH_TIMEOUT`,
//! `LH_PUBLISH_URL`, `LH_PUBLISH_DEDUPES`, `LH_TOOL_FAULTS`; see the
//! `toolbox` module's table.
//!
//! Ledger keys are `<job_id>.<key>`, written with `Nats-TTL: never`: they
//! outlive the bucket's retention for as long as the job exists, and
//! [`EffectsLedger::purge_job`] removes a terminal job's entries (see the
//! `ledger` module).
//!
//! Architecture Invariant: a write tool's `execute` is only ever called after
//! this process created or took over the key's `in_flight` entry, and after
//! the call's guard (when it has one) proved ownership.

mod builtin;
mod error;
mod events;
mod faults;
mod guard;
mod key;
mod ledger;
pub mod metrics;
mod netguard;
mod schema;
mod tool;
mod toolbox;

pub use builtin::fetch::{FetchConfig, FetchTool};
pub use builtin::publish::{PublishConfig, PublishTool};
pub use builtin::search::{SearchConfig, SearchTool};
pub use error::{request_may_have_been_sent, Disposition, ToolError};
pub use events::{CollectEvents, NoEvents, ToolEvent, ToolEventKind, ToolEvents};
pub use faults::{FaultMode, Faults};
pub use guard::{EffectGuard, OwnerGuard};
pub use key::{
    arg_digest, business_key_id, canonical_json, idempotency_key, incarnation_key, ledger_key,
    read_key, step_id,
};
pub use ledger::{EffectState, EffectsLedger, LedgerEntry, Purged};
pub use netguard::{AllowList, NetGuard};
pub use tool::{ExecCtx, Reconcile, Tool, ToolKind, ToolSpec};
pub use toolbox::{
    CallCtx, Outcome, RetryPolicy, ToolOutput, Toolbox, ToolboxConfig, DEFAULT_BASE_URL,
    ENV_VARS as TOOL_ENV_VARS,
};
