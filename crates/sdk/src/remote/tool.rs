//! A tool of the service ([`RemoteTool`]), run through the effects ledger:
//! its endpoint called with the idempotency key, its `find_existing` asked.

use std::sync::Arc;

use serde_json::{json, Value};

use super::client::{tool_error, Client};
use super::PROTOCOL;
use crate::{BoxFuture, ExecCtx, Reconcile, Tool, ToolError, ToolSpec};

/// A write tool of the service, run through the ledger: `POST
/// {url}/tools/{name}` with the idempotency key; `find_existing` at `POST
/// {url}/tools/{name}/find_existing`.
pub(super) struct RemoteTool {
    pub(super) spec: ToolSpec,
    pub(super) client: Arc<Client>,
    /// The effect op said its destination deduplicates by the idempotency
    /// key: after `not_found`, calling again cannot repeat the effect.
    pub(super) dedupes: bool,
    /// The remote kind whose service named the tool: its business keys are
    /// its own (another kind's service never sees, nor suppresses, them).
    pub(super) kind: String,
    /// The call's arguments are an effect's `{"args", "business_key"}`;
    /// otherwise (a tool the model calls in a `generate`) the model's
    /// arguments themselves, with no business key.
    pub(super) wrapped: bool,
}

impl RemoteTool {
    /// The service's `args` and `business_key` of one call.
    fn parts<'a>(&self, args: &'a Value) -> (&'a Value, &'a Value) {
        if self.wrapped {
            (&args["args"], &args["business_key"])
        } else {
            (args, &Value::Null)
        }
    }
}

impl Tool for RemoteTool {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }
    fn endpoint(&self) -> String {
        format!("{}/tools/{}", self.client.cfg.url, self.spec.name)
    }
    fn execute<'a>(
        &'a self,
        args: &'a Value,
        ctx: &'a ExecCtx,
    ) -> BoxFuture<'a, Result<Value, ToolError>> {
        Box::pin(async move {
            let (call_args, business_key) = self.parts(args);
            let body = json!({
                "protocol": PROTOCOL,
                "type": "tool",
                "tool": self.spec.name,
                "job": {"id": ctx.job_id, "epoch": ctx.epoch},
                "step": ctx.step_id,
                "args": call_args,
                "business_key": business_key,
                "idempotency_key": ctx.idempotency_key,
            });
            let path = format!("/tools/{}", self.spec.name);
            let v = self
                .client
                .post(&path, &body, ctx.timeout)
                .await
                .map_err(tool_error)?;
            v.get("result")
                .cloned()
                .ok_or_else(|| ToolError::BadResponse("a tool answer needs `result`".into()))
        })
    }
    fn dedupes_by_key(&self) -> bool {
        self.dedupes
    }
    fn business_key(&self, _job: &str, args: &Value) -> Option<String> {
        self.parts(args)
            .1
            .as_str()
            .filter(|k| !k.is_empty())
            .map(|k| format!("{}:{}:{k}", self.kind, self.spec.name))
    }
    fn find_existing<'a>(&'a self, key: &'a str, args: &'a Value) -> BoxFuture<'a, Reconcile> {
        Box::pin(async move {
            let (call_args, business_key) = self.parts(args);
            let body = json!({
                "protocol": PROTOCOL,
                "type": "find_existing",
                "tool": self.spec.name,
                "args": call_args,
                "business_key": business_key,
                "idempotency_key": key,
            });
            let path = format!("/tools/{}/find_existing", self.spec.name);
            match self.client.post(&path, &body, self.spec.timeout).await {
                Ok(v) => match v["status"].as_str() {
                    Some("found") => Reconcile::Found(v.get("result").cloned().unwrap_or(Value::Null)),
                    Some("not_found") => Reconcile::NotFound,
                    Some("unknowable") => {
                        Reconcile::Unknowable(v["message"].as_str().unwrap_or("").to_string())
                    }
                    Some("unavailable") => {
                        Reconcile::Unavailable(v["message"].as_str().unwrap_or("").to_string())
                    }
                    other => Reconcile::Unavailable(format!(
                        "find_existing answered status {other:?} (found, not_found, unavailable, unknowable)"
                    )),
                },
                Err(e) => Reconcile::Unavailable(tool_error(e).to_string()),
            }
        })
    }
}
