//! The engine's own types, for the tests that break the protocol on
//! purpose: a stale owner writing through its gate, a fence checked by
//! hand, an index entry removed by the wrong remover, a limit written by a
//! node that no longer holds it. Each module is named for what its tests
//! break; the rest of `tests/` goes through [`crate::Fleet`].

/// Ownership: the claim decision, the gate an owner writes through, the
/// fence on its events, and the worker's section flusher behind both.
pub mod owner {
    pub use leasehold_core::machine::{self, ClaimDecision, Claimant, Owner, OwnerLiveness};
    pub use leasehold_store::events::{coherent, Fence, FenceError};
    pub use leasehold_store::liveness::SETTLE_AFTER_RECONNECT;
    pub use leasehold_store::{Gate, JobsError};
    pub use leasehold_worker::checkpoint::Flusher;
}

/// The layout's handles, for a test that opens a second connection (a
/// scoped user, another cluster node) or changes the layout under a fleet.
pub mod layout {
    pub use leasehold_store::events::Events;
    pub use leasehold_store::setup::{ensure, Fit, SetupOptions};
    pub use leasehold_store::work::Work;
    pub use leasehold_store::{Conn, Jobs, JobsError, Layout, NatsArgs};
}

/// The index of active jobs: its keys, filters and removers.
pub mod index {
    pub use leasehold_store::index::{Active, Filter, Key, Remover};
}

/// Signals sent to jobs.
pub mod signals {
    pub use leasehold_store::signals::{Sent, Signal, Signals};
}

/// Dead letters.
pub mod dlq {
    pub use leasehold_store::dlq::{Dlq, Letter};
}

/// The history of ended jobs and the recovery stream it is rebuilt from.
pub mod history {
    pub use leasehold_store::history::{self, Entry, Query, QueryText};
    pub use leasehold_store::recovery::Recovery;
}

/// Artifacts (reports, documents) in the object store.
pub mod artifacts {
    pub use leasehold_store::artifacts::{Artifacts, NewArtifact, Written};
}

/// The effects ledger: its keys and entries, and a toolbox that writes it.
pub mod ledger {
    pub use leasehold_store::effects::{open, scan_prefix};
    pub use leasehold_tools::{
        incarnation_key, ledger_key, CallCtx, EffectState, EffectsLedger, NoEvents, Toolbox,
        ToolboxConfig,
    };
}

/// Fleet-wide flow control: a node's view ([`Flow`], started by
/// [`crate::Fleet::flow_node`]) and the store the shared limits live in.
pub mod flow {
    pub use leasehold_flow::{
        provider_key, tenant_jobs_key, Flow, Limits, ProviderKey, Wait, LEARN_AFTER,
    };
    pub use leasehold_store::flow::{now_ms, FlowStore, LimitEntry, PauseKind};
}

/// Reapers run in the test's process.
pub mod reaper {
    pub use leasehold_core::shard::{shard_of, Shards, SHARDS};
    pub use leasehold_reaper::{Handle, Metrics, Options, Reaper};
}

/// The engine's kind API (below the SDK), for a test that needs a kind
/// ending in a way the SDK does not offer.
pub mod engine {
    pub use leasehold_worker::{End, Handler, JobCtx, Worker};
}

/// Every environment variable a worker process reads, with the research
/// kind's, the model's, the tools' and the telemetry's own.
pub fn worker_env_vars() -> Vec<&'static str> {
    leasehold_research::ENV_VARS
        .iter()
        .chain(leasehold_model::MODEL_ENV_VARS)
        .chain(leasehold_tools::TOOL_ENV_VARS)
        .map(|(k, _)| *k)
        .chain(["NATS_URL", "LH_PREFIX", "LH_KINDS", "LH_DEV_KINDS"])
        .chain(telemetry_env_vars())
        .collect()
}

/// The log and trace variables every process reads.
pub fn telemetry_env_vars() -> Vec<&'static str> {
    leasehold_telemetry::ENV_VARS
        .iter()
        .map(|(k, _)| *k)
        .collect()
}

/// The hash the research kind names its report by.
pub fn report_sha256_hex(s: &str) -> String {
    leasehold_research::report::sha256_hex(s)
}
