//! The registry of tools and the one way every call runs.
//!
//! [`Toolbox::call`] validates the arguments, derives the idempotency key
//! and then runs reads with backoff and writes through the effects ledger,
//! each write's effect only after the call's [`EffectGuard`] (if any)
//! proved the caller still owns the job; see the crate docs for the
//! protocol.
//!
//! Configuration ([`ToolboxConfig::from_env`]):
//!
//! | variable | default | meaning |
//! |---|---|---|
//! | `LH_SEARCH_URL` | `http://127.0.0.1:8089` | SearxNG base URL (`/search?q=..&format=json` is appended) |
//! | `LH_FETCH_ALLOW` | empty | hosts and CIDRs `fetch` may reach although private/loopback |
//! | `LH_FETCH_MAX_BYTES` | 1048576 | body size limit of `fetch` (the rest is cut, `truncated: true`) |
//! | `LH_FETCH_TIMEOUT` | `15s` | time limit of one `fetch`, redirects included |
//! | `LH_PUBLISH_URL` | `http://127.0.0.1:8089/effects` | webhook of `publish` |
//! | `LH_PUBLISH_DEDUPES` | `true` | whether the webhook deduplicates by `Idempotency-Key` |
//! | `LH_TOOL_FAULTS` | empty | injected faults, `tool:mode[:count],...` (see [`crate::Faults`]) |
//!
//! Every value is validated when the configuration is read (URLs as absolute
//! `http(s)` URLs, durations with `leasehold_core::time::parse_duration`), so
//! a worker reading it at start refuses to run with a bad one.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use leasehold_telemetry::{observe, spans};
use serde_json::Value;
use tracing::Instrument;

use crate::builtin::fetch::FetchTool;
use crate::builtin::publish::PublishTool;
use crate::builtin::search::SearchTool;
use crate::error::ToolError;
use crate::events::{ToolEvent, ToolEventKind, ToolEvents};
use crate::faults::{FaultMode, Faults};
use crate::guard::EffectGuard;
use crate::key::{idempotency_key, incarnation_key, read_key};
use crate::ledger::{now_rfc3339, EffectState, EffectsLedger, LedgerEntry};
use crate::schema::ArgSchema;
use crate::tool::{ExecCtx, Tool, ToolKind, ToolSpec};

mod config;
#[cfg(test)]
mod tests;
mod write;

pub use config::{RetryPolicy, ToolboxConfig, DEFAULT_BASE_URL, ENV_VARS};

/// Which call this is: the key is derived from these, so they must be the
/// same on every retry and resume of the step.
#[derive(Clone)]
pub struct CallCtx {
    pub job_id: String,
    /// Stable across retries/resumes: section id plus call ordinal ([`crate::step_id`]).
    pub step_id: String,
    /// The caller's claim epoch, recorded in the ledger.
    pub epoch: u64,
    /// The job's incarnation (its record's `created_at`): part of every
    /// write's key, so an id reused after retention never shares a key
    /// with an earlier job of that id. `None` for callers without a record
    /// (`leasehold tool call`).
    pub incarnation: Option<String>,
    /// Proves, right before a write's effect, that the caller still owns
    /// the job (workers pass their gate's [`crate::OwnerGuard`]); `None`
    /// for callers that own nothing (`leasehold tool call`).
    pub guard: Option<Arc<dyn EffectGuard>>,
}

impl CallCtx {
    pub fn new(job_id: impl Into<String>, step_id: impl Into<String>, epoch: u64) -> Self {
        CallCtx {
            job_id: job_id.into(),
            step_id: step_id.into(),
            epoch,
            incarnation: None,
            guard: None,
        }
    }

    /// The same call, of the job's incarnation `created_at`.
    pub fn of_incarnation(mut self, created_at: impl Into<String>) -> Self {
        self.incarnation = Some(created_at.into()).filter(|c: &String| !c.is_empty());
        self
    }

    /// The same call, its write effects guarded by `guard`.
    pub fn guarded(mut self, guard: Arc<dyn EffectGuard>) -> Self {
        self.guard = Some(guard);
        self
    }
}

impl std::fmt::Debug for CallCtx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CallCtx")
            .field("job_id", &self.job_id)
            .field("step_id", &self.step_id)
            .field("epoch", &self.epoch)
            .field("incarnation", &self.incarnation)
            .field("guarded", &self.guard.is_some())
            .finish()
    }
}

/// How a result was obtained.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The tool ran now.
    Executed,
    /// A stored result of an earlier run (same key or same business key).
    Replayed,
    /// An earlier run with unknown outcome was resolved at the destination
    /// (found there, or re-run with the same key at a deduplicating one).
    Reconciled,
}

/// The result of a successful call. The caller records it with the step.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ToolOutput {
    pub tool: String,
    pub kind: ToolKind,
    /// The idempotency key of the call.
    pub key: String,
    pub value: Value,
    pub outcome: Outcome,
    /// Executions made by this call (0 for a replay).
    pub attempts: u32,
}

struct Registered {
    tool: Arc<dyn Tool>,
    schema: ArgSchema,
}

/// The registry of tools plus the ledger, the event sink and the faults.
pub struct Toolbox {
    tools: BTreeMap<String, Registered>,
    ledger: Option<EffectsLedger>,
    events: Arc<dyn ToolEvents>,
    faults: Arc<Faults>,
    retry: RetryPolicy,
    /// Where each call and effect is counted (the worker's metrics).
    observer: Arc<dyn observe::Observer>,
}

/// Emits events of one call.
struct Reporter<'a> {
    sink: &'a dyn ToolEvents,
    ctx: &'a CallCtx,
    tool: &'a str,
    key: &'a str,
}

impl Reporter<'_> {
    fn emit(
        &self,
        kind: ToolEventKind,
        ok: Option<bool>,
        error: Option<&str>,
        detail: Option<String>,
    ) {
        self.sink.emit(ToolEvent {
            kind,
            tool: self.tool.to_string(),
            key: self.key.to_string(),
            job_id: self.ctx.job_id.clone(),
            step_id: self.ctx.step_id.clone(),
            epoch: self.ctx.epoch,
            at: now_rfc3339(),
            ok,
            error: error.map(str::to_string),
            detail,
        });
    }

    fn refused(&self, e: &ToolError) {
        self.emit(
            ToolEventKind::Refused,
            Some(false),
            Some(e.class()),
            Some(e.to_string()),
        );
    }
}

/// One turn of the ledger loop: a final answer, or "read the key again".
enum Step {
    Return(Result<ToolOutput, ToolError>),
    Again,
}

impl Toolbox {
    /// An empty toolbox. Without a ledger, write tools refuse to run.
    pub fn new(ledger: Option<EffectsLedger>, events: Arc<dyn ToolEvents>) -> Self {
        Toolbox {
            tools: BTreeMap::new(),
            ledger,
            events,
            faults: Arc::new(Faults::default()),
            retry: RetryPolicy::default(),
            observer: observe::none(),
        }
    }

    /// Counts its calls and effects in `observer` (a job's toolbox: the
    /// worker's metrics, `JobCtx::observer`); a new toolbox counts nothing.
    pub fn observed(mut self, observer: Arc<dyn observe::Observer>) -> Self {
        self.observer = observer;
        self
    }

    /// The built-in tools (`search`, `fetch`, `publish`) configured by `config`.
    pub fn builtin(
        config: &ToolboxConfig,
        ledger: Option<EffectsLedger>,
        events: Arc<dyn ToolEvents>,
    ) -> Result<Self, ToolError> {
        let mut tb = Toolbox::new(ledger, events);
        tb.retry = config.read_retry.clone();
        tb.faults
            .parse_into(&config.faults)
            .map_err(ToolError::Config)?;
        tb.register(Arc::new(SearchTool::new(config.search.clone())?))?;
        tb.register(Arc::new(FetchTool::new(config.fetch.clone())))?;
        tb.register(Arc::new(PublishTool::new(config.publish.clone())?))?;
        Ok(tb)
    }

    /// Adds (or replaces) a tool; its schema must compile.
    pub fn register(&mut self, tool: Arc<dyn Tool>) -> Result<(), ToolError> {
        let spec = tool.spec();
        let schema = ArgSchema::compile(&spec.name, &spec.schema)?;
        self.tools
            .insert(spec.name.clone(), Registered { tool, schema });
        Ok(())
    }

    /// Replaces the read retry policy.
    pub fn set_retry(&mut self, retry: RetryPolicy) {
        self.retry = retry;
    }

    /// Replaces the default event sink.
    pub fn set_events(&mut self, events: Arc<dyn ToolEvents>) {
        self.events = events;
    }

    /// The fault injector of this toolbox (`faults().fail_next(n, mode)`).
    pub fn faults(&self) -> &Faults {
        &self.faults
    }

    pub fn ledger(&self) -> Option<&EffectsLedger> {
        self.ledger.as_ref()
    }

    /// The declarations of all tools, sorted by name.
    pub fn specs(&self) -> Vec<&ToolSpec> {
        self.tools.values().map(|r| r.tool.spec()).collect()
    }

    pub fn tool(&self, name: &str) -> Option<&Arc<dyn Tool>> {
        self.tools.get(name).map(|r| &r.tool)
    }

    /// The OpenAI `tools[]` array of every tool that is not hosted.
    pub fn openai_tools(&self) -> Value {
        Value::Array(
            self.specs()
                .into_iter()
                .filter(|s| s.kind != ToolKind::Hosted)
                .map(ToolSpec::openai_function)
                .collect(),
        )
    }

    /// Checks a call's tool name and arguments without running it (the same
    /// check [`Toolbox::call`] makes first).
    pub fn validate(&self, name: &str, args: &Value) -> Result<&ToolSpec, ToolError> {
        let reg = self
            .tools
            .get(name)
            .ok_or_else(|| ToolError::UnknownTool(name.to_string()))?;
        reg.schema.validate(name, args)?;
        Ok(reg.tool.spec())
    }

    /// Runs one call, reporting to the toolbox's event sink.
    pub async fn call(
        &self,
        ctx: &CallCtx,
        name: &str,
        args: &Value,
    ) -> Result<ToolOutput, ToolError> {
        self.call_with(ctx, name, args, self.events.as_ref()).await
    }

    /// Runs one call, reporting to `events` (e.g. a per-job publisher), in
    /// an `execute_tool {name}` span, counted in the process's metrics.
    pub async fn call_with(
        &self,
        ctx: &CallCtx,
        name: &str,
        args: &Value,
        events: &dyn ToolEvents,
    ) -> Result<ToolOutput, ToolError> {
        let span = spans::execute_tool(name, None);
        let r = self
            .call_traced(ctx, name, args, events)
            .instrument(span.clone())
            .await;
        let write = matches!(&r, Ok(o) if o.kind == ToolKind::Write)
            || self
                .tools
                .get(name)
                .is_some_and(|r| r.tool.spec().kind == ToolKind::Write);
        let effect = match &r {
            Ok(o) if write => Some(match o.outcome {
                Outcome::Executed => observe::EffectOutcome::Executed,
                Outcome::Replayed => observe::EffectOutcome::Replayed,
                Outcome::Reconciled => observe::EffectOutcome::Reconciled,
            }),
            Err(ToolError::UncertainEffect { .. }) => Some(observe::EffectOutcome::Parked),
            _ => None,
        };
        if let Some(e) = effect {
            spans::record_effect(&span, e.as_str());
            self.observer.effect(name, e);
        }
        let outcome = match &r {
            Ok(_) => observe::ToolOutcome::Ok,
            Err(e) => {
                spans::record_error(&span, e.class());
                if e.is_refusal() {
                    observe::ToolOutcome::Refused
                } else {
                    observe::ToolOutcome::Error
                }
            }
        };
        self.observer.tool_call(name, outcome);
        r
    }

    async fn call_traced(
        &self,
        ctx: &CallCtx,
        name: &str,
        args: &Value,
        events: &dyn ToolEvents,
    ) -> Result<ToolOutput, ToolError> {
        let write = self
            .tools
            .get(name)
            .is_some_and(|r| r.tool.spec().kind == ToolKind::Write);
        // A write is identified by its step; what it says is checked
        // against the digest stored with the key.
        let key = if write {
            self.write_key(ctx, name).await
        } else {
            read_key(&ctx.job_id, &ctx.step_id, name, args)
        };
        let rep = Reporter {
            sink: events,
            ctx,
            tool: name,
            key: &key,
        };
        let Some(reg) = self.tools.get(name) else {
            let e = ToolError::UnknownTool(name.to_string());
            rep.refused(&e);
            return Err(e);
        };
        if let Err(e) = reg.schema.validate(name, args) {
            rep.refused(&e);
            return Err(e);
        }
        match reg.tool.spec().kind {
            ToolKind::Read => {
                self.call_read(ctx, reg.tool.as_ref(), args, &key, &rep)
                    .await
            }
            ToolKind::Write => {
                self.call_write(ctx, reg.tool.as_ref(), args, &key, &rep)
                    .await
            }
            ToolKind::Hosted => {
                let e = ToolError::Config(format!(
                    "`{name}` is hosted: it runs at the model provider, not here"
                ));
                rep.refused(&e);
                Err(e)
            }
        }
    }

    /// A write's key: of the job's incarnation, unless the ledger already
    /// holds the step under the key without one (an effect begun by a
    /// worker from before keys named the incarnation keeps its key, so an
    /// upgrade in the middle of a job never sends it again).
    async fn write_key(&self, ctx: &CallCtx, tool: &str) -> String {
        let legacy = idempotency_key(&ctx.job_id, &ctx.step_id, tool);
        let Some(inc) = ctx.incarnation.as_deref() else {
            return legacy;
        };
        let key = incarnation_key(&ctx.job_id, inc, &ctx.step_id, tool);
        if let Some(ledger) = &self.ledger {
            if let (Ok(None), Ok(Some(_))) = (
                ledger.get(&ctx.job_id, &key).await,
                ledger.get(&ctx.job_id, &legacy).await,
            ) {
                return legacy;
            }
        }
        key
    }

    fn exec_ctx(&self, ctx: &CallCtx, tool: &dyn Tool, key: &str) -> ExecCtx {
        ExecCtx {
            job_id: ctx.job_id.clone(),
            step_id: ctx.step_id.clone(),
            epoch: ctx.epoch,
            idempotency_key: key.to_string(),
            timeout: tool.spec().timeout,
        }
    }

    /// One execution with the tool's timeout and any armed fault.
    async fn run_once(
        &self,
        tool: &dyn Tool,
        args: &Value,
        exec: &ExecCtx,
    ) -> Result<Value, ToolError> {
        let spec = tool.spec();
        let fault = self.faults.take(&spec.name);
        if let Some(mode) = fault {
            tracing::info!(tool = %spec.name, key = %exec.idempotency_key, ?mode, "injecting fault");
        }
        match fault {
            Some(FaultMode::TimeoutBeforeCommit) => return Err(ToolError::Timeout(spec.timeout)),
            Some(FaultMode::Error5xx) => {
                return Err(ToolError::Upstream {
                    status: 503,
                    message: "injected error_5xx".into(),
                })
            }
            _ => {}
        }
        let slow = (fault == Some(FaultMode::Slow)).then(|| self.faults.slow_delay());
        let run = async {
            if let Some(d) = slow {
                tokio::time::sleep(d).await;
            }
            tool.execute(args, exec).await
        };
        let result = tokio::time::timeout(spec.timeout, run)
            .await
            .map_err(|_| ToolError::Timeout(spec.timeout))?;
        match fault {
            // The effect happened; the caller just never hears about it.
            Some(FaultMode::TimeoutAfterCommit) => {
                result.and(Err(ToolError::Timeout(spec.timeout)))
            }
            Some(FaultMode::EmptySuccess) => result.and(Err(ToolError::EmptySuccess)),
            _ => result,
        }
    }

    async fn call_read(
        &self,
        ctx: &CallCtx,
        tool: &dyn Tool,
        args: &Value,
        key: &str,
        rep: &Reporter<'_>,
    ) -> Result<ToolOutput, ToolError> {
        let exec = self.exec_ctx(ctx, tool, key);
        rep.emit(ToolEventKind::Started, None, None, None);
        let start = Instant::now();
        let mut attempt = 0u32;
        loop {
            attempt += 1;
            match self.run_once(tool, args, &exec).await {
                Ok(value) => {
                    rep.emit(
                        ToolEventKind::Finished,
                        Some(true),
                        None,
                        Some(format!("attempts={attempt}")),
                    );
                    return Ok(self.output(tool, key, value, Outcome::Executed, attempt));
                }
                Err(e) if e.is_retryable() && attempt < self.retry.max_attempts.max(1) => {
                    let delay = self.retry.delay(attempt);
                    if start.elapsed() + delay > self.retry.deadline {
                        rep.emit(
                            ToolEventKind::Finished,
                            Some(false),
                            Some(e.class()),
                            Some(format!("attempts={attempt}: {e}")),
                        );
                        return Err(e);
                    }
                    tracing::debug!(tool = %tool.spec().name, attempt, ?delay, error = %e, "retrying read");
                    tokio::time::sleep(delay).await;
                }
                Err(e) => {
                    rep.emit(
                        ToolEventKind::Finished,
                        Some(false),
                        Some(e.class()),
                        Some(format!("attempts={attempt}: {e}")),
                    );
                    return Err(e);
                }
            }
        }
    }

    fn output(
        &self,
        tool: &dyn Tool,
        key: &str,
        value: Value,
        outcome: Outcome,
        attempts: u32,
    ) -> ToolOutput {
        ToolOutput {
            tool: tool.spec().name.clone(),
            kind: tool.spec().kind,
            key: key.to_string(),
            value,
            outcome,
            attempts,
        }
    }

    fn entry(
        &self,
        ctx: &CallCtx,
        tool: &dyn Tool,
        state: EffectState,
        digest: &str,
        bk: Option<&String>,
    ) -> LedgerEntry {
        LedgerEntry {
            state,
            tool: tool.spec().name.clone(),
            arg_digest: digest.to_string(),
            job_id: ctx.job_id.clone(),
            step_id: ctx.step_id.clone(),
            epoch: ctx.epoch,
            at: now_rfc3339(),
            result: None,
            business_key: bk.cloned(),
            via: None,
        }
    }
}
