//! The engine's side of a kind: the [`Handler`] one attempt runs through.
//! Kinds are written against the SDK (`leasehold::Kind`, the built-in kinds
//! included), which gives the worker one handler per kind; the trait is
//! the engine's own.
//!
//! A handler runs one claimed attempt of a job. It never writes the job
//! record's status itself: it returns the attempt's [`End`], and the
//! runner's one executor writes it through the owner-checked gate. It must return
//! promptly when [`JobCtx::cancel`] fires (ownership lost, cancellation, or
//! shutdown handoff).

use std::sync::Arc;

use async_trait::async_trait;
use leasehold_core::{End, JobRecord};
use leasehold_store::events::{Fence, FenceError};
use leasehold_store::{Conn, Gate};
use serde_json::Value;
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

/// Everything a handler may use for one attempt.
#[derive(Clone)]
pub struct JobCtx {
    /// The record as claimed (epoch, attempts, spec, ...).
    pub record: JobRecord,
    /// The spec's input object.
    pub input: Value,
    /// Fires when the attempt must stop (ownership lost, cancel, handoff).
    pub cancel: CancellationToken,
    /// Set before `cancel` fires when the stop is a cancel someone asked
    /// for (not a lost claim, a hand-back or the deadline): the attempt's
    /// stop watcher decides it, once, for every handler.
    pub cancel_asked: Arc<std::sync::atomic::AtomicBool>,
    /// Owner-checked writes of this claim.
    pub gate: Gate,
    /// This owner's fenced event publisher.
    pub fence: Arc<Mutex<Fence>>,
    pub conn: Conn,
    /// The worker's flow control: a run's model requests are admitted by it
    /// (`RunContext::flow`), so the fleet's limits and pauses apply.
    pub flow: std::sync::Arc<leasehold_flow::Flow>,
    /// The worker's metrics, for what reports on the job's behalf (its
    /// toolbox, its checkpoint flusher).
    pub observer: std::sync::Arc<dyn leasehold_telemetry::observe::Observer>,
}

impl JobCtx {
    /// Publishes an event of this owner under the server-side fence.
    pub async fn emit(&self, ty: &str, data: Value) -> Result<u64, FenceError> {
        self.fence.lock().await.publish(ty, data).await
    }
}

/// A kind of job.
#[async_trait]
pub trait Handler: Send + Sync + 'static {
    async fn run(&self, ctx: JobCtx) -> End;
}
