//! [`AgentTools`]: a toolbox offered to the agent runtime's section runner
//! (its `ToolExecutor`), one adapter for the research sections and for the
//! SDK's `ctx.agent`.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use crate::runner::{ToolExecutor, ToolOutcome};
use serde_json::Value;

use leasehold_tools::{CallCtx, CollectEvents, Disposition, EffectGuard, ToolEvents, Toolbox};

/// Some of a toolbox's tools, offered to one conversation of one job.
pub struct AgentTools {
    pub toolbox: Arc<Toolbox>,
    pub job_id: String,
    /// The job's incarnation (part of every write's key).
    pub incarnation: String,
    pub epoch: u64,
    /// Stable id of the conversation (a research section `e0.s1`, an SDK
    /// step `agent:book#0`): the prefix of every call's step id.
    pub conversation: String,
    /// The tools offered, by name.
    pub offered: Vec<String>,
    /// Proves ownership before any write effect (reads never ask it).
    pub guard: Arc<dyn EffectGuard>,
    /// Where each call's tool events go, in order.
    pub events: Arc<dyn ToolEvents>,
}

impl ToolExecutor for AgentTools {
    fn specs(&self) -> Vec<Value> {
        match self.toolbox.openai_tools() {
            Value::Array(all) => all
                .into_iter()
                .filter(|t| {
                    t.pointer("/function/name")
                        .and_then(Value::as_str)
                        .is_some_and(|n| self.offered.iter().any(|o| o == n))
                })
                .collect(),
            _ => Vec::new(),
        }
    }

    fn call<'a>(
        &'a self,
        name: &'a str,
        args: &'a Value,
        call_id: &'a str,
    ) -> Pin<Box<dyn Future<Output = ToolOutcome> + Send + 'a>> {
        Box::pin(async move {
            if !self.offered.iter().any(|o| o == name) {
                return ToolOutcome::Error(format!("tool `{name}` is not available here"));
            }
            // The call id is stable across retries of the same proposal and
            // across resumes (the journal keeps it), so the step id is too.
            let ctx = CallCtx::new(
                &self.job_id,
                format!("{}/{call_id}", self.conversation),
                self.epoch,
            )
            .of_incarnation(&self.incarnation)
            .guarded(self.guard.clone());
            let collected = CollectEvents::new();
            let r = self.toolbox.call_with(&ctx, name, args, &collected).await;
            for ev in collected.events() {
                self.events.emit(ev);
            }
            match r {
                Ok(out) => ToolOutcome::Ok(match out.value {
                    Value::String(s) => s,
                    v => v.to_string(),
                }),
                Err(e) => match e.disposition() {
                    Disposition::ReturnToModel => {
                        ToolOutcome::Error(e.to_tool_result().to_string())
                    }
                    Disposition::Park => ToolOutcome::Uncertain(e.to_string()),
                    // Ownership lost (`Stop`): the worker cancels the attempt.
                    Disposition::Retry | Disposition::Fail | Disposition::Stop => {
                        ToolOutcome::Failed(e.to_string())
                    }
                },
            }
        })
    }
}
