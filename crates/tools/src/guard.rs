//! Proof of ownership right before a write effect.
//!
//! The effects ledger makes one effect per key; it cannot tell whether the
//! caller may still act for the job. A worker that paused (GC, SIGSTOP, a
//! partition) after its last checkpoint wakes up believing it owns the job
//! while a newer owner runs it. Reading the record proves nothing (the read
//! can be stale, and the caller can pause again right after it), so the
//! toolbox asks the call's [`EffectGuard`] for a *write* that only the
//! owner can make, right before the effect: only the recording of the key
//! as `in_flight` (or its takeover) comes between the proof and the
//! request. A refusal stops the call with nothing sent and nothing
//! recorded. The proof cannot cover a pause *after* it; the effects ledger
//! does (one step, one key, one effect).

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use leasehold_store::{Gate, JobsError};

use crate::error::ToolError;

/// Proves, right before a write effect runs, that the caller may still
/// cause it. [`ToolError::OwnershipLost`] stops the call (and the
/// attempt); any other error is retried later.
pub trait EffectGuard: Send + Sync {
    fn prove(&self) -> BoxFuture<'_, Result<(), ToolError>>;
}

/// The owner's proof: a fenced write of the job's record through its
/// [`Gate`] ([`Gate::touch`]), refused once anyone else changed the job's
/// ownership. A transient refusal (NATS unavailable, this worker's session
/// not confirmed lately) is retried for a few seconds, then reported as
/// [`ToolError::OwnershipUnproven`].
pub struct OwnerGuard {
    gate: Gate,
    patience: Duration,
}

impl OwnerGuard {
    pub fn new(gate: Gate) -> Self {
        OwnerGuard {
            gate,
            patience: Duration::from_secs(5),
        }
    }

    /// Shared, as a [`crate::CallCtx`] takes it.
    pub fn shared(gate: Gate) -> Arc<dyn EffectGuard> {
        Arc::new(Self::new(gate))
    }

    /// Proves ownership now (also for effects outside the toolbox, such as
    /// an artifact write).
    pub async fn prove_now(&self) -> Result<(), ToolError> {
        let deadline = tokio::time::Instant::now() + self.patience;
        let mut backoff =
            leasehold_core::retry::Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
        loop {
            let pause = backoff.pause();
            match self.gate.touch().await {
                Ok(_) => return Ok(()),
                Err(e) if e.is_transient() => {
                    if tokio::time::Instant::now() + pause >= deadline {
                        return Err(ToolError::OwnershipUnproven(e.to_string()));
                    }
                    tracing::debug!(job = %self.gate.id, error = %e, "ownership not proven yet; retrying");
                    tokio::time::sleep(pause).await;
                }
                Err(e @ JobsError::Corrupt { .. }) => {
                    return Err(ToolError::OwnershipUnproven(e.to_string()))
                }
                // Refused by the record: another owner, another status, or
                // no record at all.
                Err(e) => return Err(ToolError::OwnershipLost(e.to_string())),
            }
        }
    }
}

impl EffectGuard for OwnerGuard {
    fn prove(&self) -> BoxFuture<'_, Result<(), ToolError>> {
        Box::pin(self.prove_now())
    }
}
