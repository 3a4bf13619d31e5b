//! `deliver`: a built-in kind with one side effect, for tests and the demo of
//! the effects ledger. Input `{"title": T, "document": D}`; it calls the
//! `publish` tool once under the step id `deliver#0`, so every attempt and
//! every reclaim of the job uses the same idempotency key: a delivery whose
//! outcome is unknown is reconciled at the destination before anything runs
//! again, and an unknowable outcome parks the job instead of guessing. The
//! effect runs only after a fenced write proved this attempt still owns the
//! job (the gate's `OwnerGuard`).

use std::sync::Arc;

use async_trait::async_trait;
use leasehold_proto::JobResult;
use leasehold_tools::{
    CallCtx, CollectEvents, Disposition, EffectsLedger, OwnerGuard, Toolbox, ToolboxConfig,
};
use serde_json::json;
use tokio::sync::OnceCell;

use crate::handler::{Handler, HandlerError, JobCtx, Outcome};

/// The `deliver` handler; its toolbox is built on first use.
#[derive(Default)]
pub struct Deliver {
    toolbox: OnceCell<Toolbox>,
}

impl Deliver {
    async fn toolbox(&self, ctx: &JobCtx) -> Result<&Toolbox, HandlerError> {
        self.toolbox
            .get_or_try_init(|| async {
                let cfg = ToolboxConfig::from_env()
                    .map_err(|e| HandlerError::terminal(format!("tool configuration: {e}")))?;
                let ledger = EffectsLedger::open(&ctx.conn.js, &ctx.conn.layout.effects_bucket())
                    .await
                    .map_err(|e| HandlerError::retryable(format!("effects ledger: {e}")))?;
                Toolbox::builtin(&cfg, Some(ledger), Arc::new(leasehold_tools::NoEvents))
                    .map_err(|e| HandlerError::terminal(format!("toolbox: {e}")))
            })
            .await
    }
}

#[async_trait]
impl Handler for Deliver {
    async fn run(&self, ctx: JobCtx) -> Result<Outcome, HandlerError> {
        let tb = self.toolbox(&ctx).await?;
        let args = json!({
            "title": ctx.input.get("title").and_then(|v| v.as_str()).unwrap_or("untitled"),
            "document": ctx.input.get("document").and_then(|v| v.as_str()).unwrap_or(""),
        });
        let call = CallCtx::new(&ctx.record.id, "deliver#0", ctx.record.epoch)
            .of_incarnation(&ctx.record.created_at)
            .guarded(OwnerGuard::shared(ctx.gate.clone()));
        let events = CollectEvents::new();
        let res = tokio::select! {
            r = tb.call_with(&call, "publish", &args, &events) => r,
            _ = ctx.cancel.cancelled() => return Err(HandlerError::cancelled()),
        };
        for ev in events.events() {
            let _ = ctx
                .emit("tool", serde_json::to_value(&ev).unwrap_or_default())
                .await;
        }
        match res {
            Ok(out) => Ok(Outcome::Completed(JobResult {
                output: json!({"key": out.key, "outcome": out.outcome, "value": out.value})
                    .to_string(),
                ..Default::default()
            })),
            Err(e) => match e.disposition() {
                Disposition::Park => Ok(Outcome::Parked {
                    reason: e.class().into(),
                    message: e.to_string(),
                    step: None,
                }),
                // Not the owner any more: nothing ran, nothing to write.
                Disposition::Stop => Err(HandlerError::cancelled()),
                Disposition::Retry => Err(HandlerError::retryable(e.to_string())),
                _ => Err(HandlerError::terminal(e.to_string())),
            },
        }
    }
}
