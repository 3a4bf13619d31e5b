//! What a tool is: its declaration ([`ToolSpec`]) and its behaviour ([`Tool`]).

use std::time::Duration;

use futures::future::BoxFuture;
use serde_json::Value;

use crate::error::ToolError;

/// How a tool touches the world, which decides how the toolbox runs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolKind {
    /// No side effects: retried with backoff, result recorded with the step.
    Read,
    /// A side effect: runs at most once per idempotency key via the ledger.
    Write,
    /// Runs at the model provider (e.g. a provider's own web search); the
    /// toolbox only validates and reports it.
    Hosted,
}

impl ToolKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ToolKind::Read => "read",
            ToolKind::Write => "write",
            ToolKind::Hosted => "hosted",
        }
    }
}

/// A tool's declaration: what the model is told and what the toolbox enforces.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ToolSpec {
    pub name: String,
    pub description: String,
    pub kind: ToolKind,
    /// JSON Schema of the arguments; calls are validated against it first.
    pub schema: Value,
    /// Upper bound of one execution (one attempt for reads).
    #[serde(with = "secs_f64")]
    pub timeout: Duration,
}

mod secs_f64 {
    pub fn serialize<S: serde::Serializer>(
        d: &std::time::Duration,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64())
    }
}

impl ToolSpec {
    /// The OpenAI Chat Completions `tools[]` entry for this tool.
    pub fn openai_function(&self) -> Value {
        serde_json::json!({
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.schema,
            }
        })
    }
}

/// What one execution knows about its call.
#[derive(Debug, Clone)]
pub struct ExecCtx {
    pub job_id: String,
    pub step_id: String,
    pub epoch: u64,
    /// The idempotency key; writes must send it to the destination.
    pub idempotency_key: String,
    pub timeout: Duration,
}

/// What a destination says about an effect key during reconciliation.
#[derive(Debug, Clone, PartialEq)]
pub enum Reconcile {
    /// The effect happened; this is its result.
    Found(Value),
    /// The destination says it has no effect with this key.
    NotFound,
    /// The destination cannot be asked, or answered in a way that does not
    /// tell: the outcome is unknowable and the job must be parked.
    Unknowable(String),
    /// The destination could not be asked right now (unreachable, 5xx, 429):
    /// the step is retried later with the key still `in_flight`.
    Unavailable(String),
}

/// A tool. Implementations must be cheap to share (`Arc<dyn Tool>`).
pub trait Tool: Send + Sync {
    fn spec(&self) -> &ToolSpec;

    /// Where the tool goes (URL), for `leasehold tool list` and logs.
    fn endpoint(&self) -> String {
        String::new()
    }

    /// Runs the tool once. Writes must pass `ctx.idempotency_key` on to the
    /// destination. The toolbox applies the timeout; implementations may
    /// apply tighter ones.
    fn execute<'a>(
        &'a self,
        args: &'a Value,
        ctx: &'a ExecCtx,
    ) -> BoxFuture<'a, Result<Value, ToolError>>;

    /// For writes: a natural key of the effect (e.g. job id + document
    /// digest), so the same effect requested by a later step is not repeated.
    fn business_key(&self, _job_id: &str, _args: &Value) -> Option<String> {
        None
    }

    /// For writes: asks the destination whether the effect with this key
    /// happened. The default cannot know.
    fn find_existing<'a>(&'a self, _key: &'a str, _args: &'a Value) -> BoxFuture<'a, Reconcile> {
        Box::pin(async { Reconcile::Unknowable("the tool cannot look up earlier effects".into()) })
    }

    /// For writes: whether the destination deduplicates by the idempotency
    /// key, so executing again with the same key cannot repeat the effect.
    fn dedupes_by_key(&self) -> bool {
        false
    }
}
