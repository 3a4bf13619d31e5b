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
use std::time::{Duration, Instant};

use leasehold_telemetry::{observe, spans};
use serde_json::Value;
use tracing::Instrument;

use crate::builtin::fetch::{FetchConfig, FetchTool};
use crate::builtin::publish::{PublishConfig, PublishTool};
use crate::builtin::search::{SearchConfig, SearchTool};
use crate::error::ToolError;
use crate::events::{ToolEvent, ToolEventKind, ToolEvents};
use crate::faults::{FaultMode, Faults};
use crate::guard::EffectGuard;
use crate::key::{
    arg_digest, business_key_id, check_job_id, idempotency_key, incarnation_key, read_key,
};
use crate::ledger::{now_rfc3339, BusinessKeyEntry, EffectState, EffectsLedger, LedgerEntry};
use crate::schema::ArgSchema;
use crate::tool::{ExecCtx, Reconcile, Tool, ToolKind, ToolSpec};

/// Every variable [`ToolboxConfig::from_env`] reads, with what it means and
/// its default (shown in `leasehold-worker --help`).
pub const ENV_VARS: &[(&str, &str)] = &[
    (
        "LH_SEARCH_URL",
        "SearxNG base URL of the search tool [default: http://127.0.0.1:8089]",
    ),
    (
        "LH_FETCH_ALLOW",
        "hosts and CIDRs fetch may reach although private or loopback, comma-separated [default: none]",
    ),
    (
        "LH_FETCH_MAX_BYTES",
        "body size limit of fetch [default: 1048576]",
    ),
    (
        "LH_FETCH_TIMEOUT",
        "time limit of one fetch, redirects included [default: 15s]",
    ),
    (
        "LH_PUBLISH_URL",
        "webhook of the publish tool, called with an Idempotency-Key [default: http://127.0.0.1:8089/effects]",
    ),
    (
        "LH_PUBLISH_DEDUPES",
        "whether the webhook deduplicates by Idempotency-Key [default: true]",
    ),
    (
        "LH_TOOL_FAULTS",
        "injected tool faults for tests, tool:mode[:count],... [default: none]",
    ),
];

/// The simulator's address, the default of every endpoint.
pub const DEFAULT_BASE_URL: &str = "http://127.0.0.1:8089";

/// How reads are retried: capped exponential backoff with full jitter,
/// bounded by attempts and by a deadline.
#[derive(Debug, Clone)]
pub struct RetryPolicy {
    /// Attempts in all, the first included (default 4).
    pub max_attempts: u32,
    /// Backoff before attempt n+1 is uniform in `[0, min(cap, base * 2^n)]`.
    pub base: Duration,
    pub cap: Duration,
    /// No retry starts after this much time since the first attempt.
    pub deadline: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 4,
            base: Duration::from_millis(200),
            cap: Duration::from_secs(5),
            deadline: Duration::from_secs(60),
        }
    }
}

impl RetryPolicy {
    fn delay(&self, attempt: u32) -> Duration {
        use leasehold_core::retry::{capped_exponential, full_jitter};
        full_jitter(
            capped_exponential(self.base, self.cap, attempt),
            &mut rand::thread_rng(),
        )
    }
}

/// Configuration of the built-in tools. Every field has an env override (see
/// the module docs).
#[derive(Debug, Clone)]
pub struct ToolboxConfig {
    pub search: SearchConfig,
    pub fetch: FetchConfig,
    pub publish: PublishConfig,
    pub read_retry: RetryPolicy,
    /// `LH_TOOL_FAULTS` syntax; armed when the toolbox is built.
    pub faults: String,
}

impl Default for ToolboxConfig {
    fn default() -> Self {
        Self::with_base_url(DEFAULT_BASE_URL)
    }
}

impl ToolboxConfig {
    /// Every endpoint on one base URL (the simulator's), nothing allow-listed.
    pub fn with_base_url(base: &str) -> Self {
        let base = base.trim_end_matches('/');
        ToolboxConfig {
            search: SearchConfig {
                url: base.to_string(),
                ..SearchConfig::default()
            },
            fetch: FetchConfig::default(),
            publish: PublishConfig {
                url: format!("{base}/effects"),
                ..PublishConfig::default()
            },
            read_retry: RetryPolicy::default(),
            faults: String::new(),
        }
    }

    /// Defaults overridden by the environment.
    pub fn from_env() -> Result<Self, ToolError> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Like [`ToolboxConfig::from_env`] with an explicit variable source
    /// (tests). Every error names the variable.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self, ToolError> {
        let mut c = ToolboxConfig::default();
        let nonempty = |k: &str| get(k).filter(|v| !v.trim().is_empty());
        let url = |k: &str| -> Result<Option<String>, ToolError> {
            let Some(v) = nonempty(k) else {
                return Ok(None);
            };
            let v = v.trim().trim_end_matches('/').to_string();
            check_url(&v).map_err(|e| ToolError::Config(format!("{k}: `{v}` {e}")))?;
            Ok(Some(v))
        };
        if let Some(v) = url("LH_SEARCH_URL")? {
            c.search.url = v;
        }
        if let Some(v) = nonempty("LH_FETCH_ALLOW") {
            c.fetch.allow = crate::netguard::AllowList::parse(&v).map_err(ToolError::Config)?;
        }
        if let Some(v) = nonempty("LH_FETCH_MAX_BYTES") {
            c.fetch.max_bytes = v.trim().parse().map_err(|_| {
                ToolError::Config(format!("LH_FETCH_MAX_BYTES: `{v}` is not a byte count"))
            })?;
        }
        if let Some(d) = leasehold_core::time::env_duration(&get, "LH_FETCH_TIMEOUT")
            .map_err(ToolError::Config)?
        {
            if d.is_zero() {
                return Err(ToolError::Config(
                    "LH_FETCH_TIMEOUT: must be longer than 0".into(),
                ));
            }
            c.fetch.timeout = d;
        }
        if let Some(v) = url("LH_PUBLISH_URL")? {
            c.publish.url = v;
        }
        if let Some(v) = nonempty("LH_PUBLISH_DEDUPES") {
            c.publish.dedupes_by_key = match v.trim() {
                "1" | "true" | "yes" => true,
                "0" | "false" | "no" => false,
                other => {
                    return Err(ToolError::Config(format!(
                        "LH_PUBLISH_DEDUPES: `{other}` is not true/false"
                    )))
                }
            };
        }
        if let Some(v) = nonempty("LH_TOOL_FAULTS") {
            Faults::default()
                .parse_into(&v)
                .map_err(|e| ToolError::Config(format!("LH_TOOL_FAULTS: {e}")))?;
            c.faults = v;
        }
        Ok(c)
    }
}

/// An absolute `http` or `https` URL with a host.
fn check_url(v: &str) -> Result<(), String> {
    let u = url::Url::parse(v).map_err(|e| format!("is not a URL ({e})"))?;
    if !matches!(u.scheme(), "http" | "https") {
        return Err(format!("has scheme {:?}, not http or https", u.scheme()));
    }
    if u.host_str().is_none_or(str::is_empty) {
        return Err("has no host".into());
    }
    Ok(())
}

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
        }
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
            observe::effect(name, e);
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
        observe::tool_call(name, outcome);
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

    async fn call_write(
        &self,
        ctx: &CallCtx,
        tool: &dyn Tool,
        args: &Value,
        key: &str,
        rep: &Reporter<'_>,
    ) -> Result<ToolOutput, ToolError> {
        let Some(ledger) = self.ledger.as_ref() else {
            let e = ToolError::Config(format!(
                "`{}` has side effects and needs the effects ledger; none is configured",
                tool.spec().name
            ));
            rep.refused(&e);
            return Err(e);
        };
        if let Err(message) = check_job_id(&ctx.job_id) {
            let e = ToolError::InvalidArgs {
                tool: tool.spec().name.clone(),
                message,
            };
            rep.refused(&e);
            return Err(e);
        }
        let job = ctx.job_id.as_str();
        let digest = arg_digest(args);
        let bk = tool.business_key(&ctx.job_id, args);
        // Each turn reads the key and acts on its state; a lost conditional
        // write means someone else moved it, so read again. The bound only
        // stops a livelock.
        for _ in 0..16 {
            let step = match ledger.get(job, key).await? {
                Some((e, _)) if e.state == EffectState::Void => {
                    let err = ToolError::Superseded {
                        key: key.to_string(),
                        reason: format!("the key was retired by epoch {} at {}", e.epoch, e.at),
                    };
                    rep.refused(&err);
                    Step::Return(Err(err))
                }
                Some((e, _)) if e.arg_digest != digest => {
                    let err = ToolError::KeyReuse {
                        key: key.to_string(),
                        stored: e.arg_digest,
                        given: digest.clone(),
                    };
                    rep.refused(&err);
                    Step::Return(Err(err))
                }
                Some((e, _)) if e.state == EffectState::Done => {
                    rep.emit(
                        ToolEventKind::Replayed,
                        Some(true),
                        None,
                        Some(format!("done by epoch {} at {}", e.epoch, e.at)),
                    );
                    Step::Return(Ok(self.output(
                        tool,
                        key,
                        e.result.unwrap_or(Value::Null),
                        Outcome::Replayed,
                        0,
                    )))
                }
                Some((e, rev)) => self.reconcile(ctx, tool, args, key, e, rev, rep).await?,
                None => {
                    let bk_step = match &bk {
                        Some(bk) => {
                            self.claim_business_key(ctx, tool, args, key, bk, &digest, rep)
                                .await?
                        }
                        None => None,
                    };
                    match bk_step {
                        Some(step) => step,
                        None => {
                            self.prove_owner(ctx, rep).await?;
                            let entry =
                                self.entry(ctx, tool, EffectState::InFlight, &digest, bk.as_ref());
                            match ledger.create(job, key, &entry).await? {
                                // Another executor created it first: read its state.
                                None => Step::Again,
                                Some(rev) => Step::Return(
                                    self.execute_write(
                                        ctx,
                                        tool,
                                        args,
                                        key,
                                        entry,
                                        rev,
                                        Outcome::Executed,
                                        rep,
                                    )
                                    .await,
                                ),
                            }
                        }
                    }
                }
            };
            if let Step::Return(r) = step {
                return r;
            }
        }
        Err(ToolError::Ledger(format!(
            "effect key {key} kept changing under us"
        )))
    }

    /// Runs a write whose `in_flight` entry (at `rev`) this call holds, and
    /// records `done`.
    #[allow(clippy::too_many_arguments)]
    async fn execute_write(
        &self,
        ctx: &CallCtx,
        tool: &dyn Tool,
        args: &Value,
        key: &str,
        entry: LedgerEntry,
        rev: u64,
        outcome: Outcome,
        rep: &Reporter<'_>,
    ) -> Result<ToolOutput, ToolError> {
        let ledger = self.ledger.as_ref().expect("checked by call_write");
        let exec = self.exec_ctx(ctx, tool, key);
        rep.emit(ToolEventKind::Started, None, None, None);
        match self.run_once(tool, args, &exec).await {
            Ok(value) => {
                let done = LedgerEntry {
                    state: EffectState::Done,
                    result: Some(value.clone()),
                    via: Some(
                        if outcome == Outcome::Executed {
                            "executed"
                        } else {
                            "reconciled"
                        }
                        .into(),
                    ),
                    at: now_rfc3339(),
                    ..entry
                };
                match ledger.update(&ctx.job_id, key, &done, rev).await {
                    Ok(Some(_)) => {}
                    // The effect happened, so the result is returned either
                    // way; whoever holds the key now reconciles it at the
                    // destination, which knows this effect by its key.
                    Ok(None) => {
                        tracing::warn!(%key, "effect done but another executor took the key over")
                    }
                    Err(e) => {
                        tracing::warn!(%key, error = %e, "effect done but `done` could not be recorded")
                    }
                }
                rep.emit(ToolEventKind::Finished, Some(true), None, None);
                Ok(self.output(tool, key, value, outcome, 1))
            }
            Err(e) => {
                // Only an entry this call created fresh may be withdrawn: a
                // taken-over one still stands for the earlier attempt.
                if outcome == Outcome::Executed && e.certainly_not_committed() {
                    // Nothing left this process: free the key for a clean retry.
                    if let Err(we) = ledger.withdraw(&ctx.job_id, key, rev).await {
                        tracing::warn!(%key, error = %we, "could not withdraw in_flight");
                    }
                }
                rep.emit(
                    ToolEventKind::Finished,
                    Some(false),
                    Some(e.class()),
                    Some(e.to_string()),
                );
                Err(e)
            }
        }
    }

    /// Proves, with the call's guard, that the caller still owns the job:
    /// the last step before a write's effect (only the `in_flight` record or
    /// its takeover comes between them). Done before anything is recorded,
    /// so a refusal, or a caller dropped while it waits for its proof,
    /// leaves nothing to reconcile.
    async fn prove_owner(&self, ctx: &CallCtx, rep: &Reporter<'_>) -> Result<(), ToolError> {
        let Some(guard) = &ctx.guard else {
            return Ok(());
        };
        guard.prove().await.inspect_err(|e| rep.refused(e))
    }

    /// An `in_flight` key: an earlier attempt may or may not have had its
    /// effect. Ask the destination; never guess.
    #[allow(clippy::too_many_arguments)]
    async fn reconcile(
        &self,
        ctx: &CallCtx,
        tool: &dyn Tool,
        args: &Value,
        key: &str,
        entry: LedgerEntry,
        rev: u64,
        rep: &Reporter<'_>,
    ) -> Result<Step, ToolError> {
        let ledger = self.ledger.as_ref().expect("checked by call_write");
        if ctx.epoch < entry.epoch {
            // A newer owner of the job holds this key: a stale executor (its
            // lease reclaimed) must not reconcile or run it.
            let err = ToolError::Superseded {
                key: key.to_string(),
                reason: format!(
                    "the key is in flight for epoch {}, newer than this executor's epoch {}",
                    entry.epoch, ctx.epoch
                ),
            };
            rep.refused(&err);
            return Ok(Step::Return(Err(err)));
        }
        let earlier = format!(
            "an earlier attempt (epoch {}, {}) left the effect in flight",
            entry.epoch, entry.at
        );
        match tool.find_existing(key, args).await {
            Reconcile::Found(value) => {
                let done = LedgerEntry {
                    state: EffectState::Done,
                    result: Some(value.clone()),
                    via: Some("reconciled".into()),
                    epoch: ctx.epoch,
                    at: now_rfc3339(),
                    ..entry
                };
                if ledger.update(&ctx.job_id, key, &done, rev).await?.is_none() {
                    return Ok(Step::Again);
                }
                rep.emit(
                    ToolEventKind::Reconciled,
                    Some(true),
                    None,
                    Some(format!("{earlier}; found at the destination")),
                );
                Ok(Step::Return(Ok(self.output(
                    tool,
                    key,
                    value,
                    Outcome::Reconciled,
                    0,
                ))))
            }
            Reconcile::NotFound if tool.dedupes_by_key() => {
                // Take the key over (conditioned on the revision we read, so
                // of two reconcilers only one runs), then run again with the
                // same key: the destination drops it if the first one lands.
                self.prove_owner(ctx, rep).await?;
                let mine = LedgerEntry {
                    epoch: ctx.epoch,
                    at: now_rfc3339(),
                    ..entry
                };
                let Some(new_rev) = ledger.update(&ctx.job_id, key, &mine, rev).await? else {
                    return Ok(Step::Again);
                };
                rep.emit(
                    ToolEventKind::Reconciled,
                    None,
                    None,
                    Some(format!("{earlier}; not found at the destination, which deduplicates by key: running again with the same key")),
                );
                Ok(Step::Return(
                    self.execute_write(
                        ctx,
                        tool,
                        args,
                        key,
                        mine,
                        new_rev,
                        Outcome::Reconciled,
                        rep,
                    )
                    .await,
                ))
            }
            Reconcile::NotFound => {
                let err = ToolError::UncertainEffect {
                    key: key.to_string(),
                    reason: format!(
                        "{earlier}; the destination has no record of it yet but does not deduplicate by key, so it may still land"
                    ),
                };
                rep.refused(&err);
                Ok(Step::Return(Err(err)))
            }
            Reconcile::Unknowable(why) => {
                let err = ToolError::UncertainEffect {
                    key: key.to_string(),
                    reason: format!("{earlier}; {why}"),
                };
                rep.refused(&err);
                Ok(Step::Return(Err(err)))
            }
            Reconcile::Unavailable(why) => {
                // Not knowable *now*: keep `in_flight` and let the step retry.
                let err = ToolError::Unreachable(format!("{earlier}; cannot reconcile yet: {why}"));
                rep.refused(&err);
                Ok(Step::Return(Err(err)))
            }
        }
    }

    /// Checks the business key before `key` is created. `None`: this call
    /// owns the business key and may go on; `Some(step)`: the answer (a
    /// replay of the effect another step already had, an uncertainty, or
    /// "read again").
    #[allow(clippy::too_many_arguments)]
    async fn claim_business_key(
        &self,
        ctx: &CallCtx,
        tool: &dyn Tool,
        args: &Value,
        key: &str,
        bk: &str,
        digest: &str,
        rep: &Reporter<'_>,
    ) -> Result<Option<Step>, ToolError> {
        let ledger = self.ledger.as_ref().expect("checked by call_write");
        let name = &tool.spec().name;
        let bk_id = business_key_id(name, bk);
        let mine = BusinessKeyEntry {
            effect_key: key.to_string(),
            tool: name.clone(),
            job_id: ctx.job_id.clone(),
            at: now_rfc3339(),
        };
        let Some((owner, bk_rev)) = ledger.get_bk(&bk_id).await? else {
            return Ok(match ledger.create_bk(&bk_id, &mine).await? {
                Some(_) => None,
                None => Some(Step::Again),
            });
        };
        if owner.effect_key == key && owner.job_id == ctx.job_id {
            return Ok(None);
        }
        // The owning effect's key lives under its own job.
        let (other_job, other) = (owner.job_id, owner.effect_key);
        match ledger.get(&other_job, &other).await? {
            Some((e, _)) if e.state == EffectState::Done => {
                // Record this step's key as done too, so its retries replay
                // directly; losing that race to a copy of ourselves is fine.
                let value = e.result.clone().unwrap_or(Value::Null);
                let done = LedgerEntry {
                    result: Some(value.clone()),
                    via: Some("business_key".into()),
                    ..self.entry(ctx, tool, EffectState::Done, digest, Some(&bk.to_string()))
                };
                ledger.create(&ctx.job_id, key, &done).await?;
                rep.emit(
                    ToolEventKind::Replayed,
                    Some(true),
                    None,
                    Some(format!(
                        "business key already delivered by step {} (key {other})",
                        e.step_id
                    )),
                );
                Ok(Some(Step::Return(Ok(self.output(
                    tool,
                    key,
                    value,
                    Outcome::Replayed,
                    0,
                )))))
            }
            Some((e, rev)) if e.state == EffectState::InFlight => {
                // Another step's effect with this business key is unresolved:
                // only the destination can say whether it happened.
                match tool.find_existing(&other, args).await {
                    Reconcile::Found(value) => {
                        let other_done = LedgerEntry {
                            state: EffectState::Done,
                            result: Some(value.clone()),
                            via: Some("reconciled".into()),
                            at: now_rfc3339(),
                            ..e
                        };
                        if ledger
                            .update(&other_job, &other, &other_done, rev)
                            .await?
                            .is_none()
                        {
                            return Ok(Some(Step::Again));
                        }
                        rep.emit(
                            ToolEventKind::Reconciled,
                            Some(true),
                            None,
                            Some(format!("business key held by in-flight key {other}, found at the destination")),
                        );
                        // Next turn replays it through the Done branch above.
                        Ok(Some(Step::Again))
                    }
                    Reconcile::Unavailable(why) => {
                        let err = ToolError::Unreachable(format!(
                            "the same business key is held by in-flight key {other}; cannot reconcile yet: {why}"
                        ));
                        rep.refused(&err);
                        Ok(Some(Step::Return(Err(err))))
                    }
                    Reconcile::NotFound | Reconcile::Unknowable(_) => {
                        let err = ToolError::UncertainEffect {
                            key: key.to_string(),
                            reason: format!(
                                "the same business key is held by step {} (key {other}, epoch {}), whose effect is still in flight with unknown outcome",
                                e.step_id, e.epoch
                            ),
                        };
                        rep.refused(&err);
                        Ok(Some(Step::Return(Err(err))))
                    }
                }
            }
            Some(_) | None => {
                // The owning key never ran (it has no entry, or was retired):
                // its executor stopped between claiming the business key and
                // recording `in_flight`, or is about to record it. Retire the
                // key so it can never run, then take the business key over.
                let void = LedgerEntry {
                    state: EffectState::Void,
                    tool: name.clone(),
                    arg_digest: String::new(),
                    job_id: other_job.clone(),
                    step_id: String::new(),
                    epoch: ctx.epoch,
                    at: now_rfc3339(),
                    result: None,
                    business_key: Some(bk.to_string()),
                    via: Some(format!(
                        "business key taken over by key {key} of job {}",
                        ctx.job_id
                    )),
                };
                if let Some((cur, _)) = ledger.get(&other_job, &other).await? {
                    if cur.state != EffectState::Void {
                        return Ok(Some(Step::Again));
                    }
                } else if ledger.create(&other_job, &other, &void).await?.is_none() {
                    return Ok(Some(Step::Again));
                }
                Ok(match ledger.update_bk(&bk_id, &mine, bk_rev).await? {
                    Some(_) => None,
                    None => Some(Step::Again),
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn config_reads_the_environment() {
        let env: HashMap<&str, &str> = [
            ("LH_SEARCH_URL", "http://searx:8080/"),
            ("LH_FETCH_ALLOW", "sim, 10.0.0.0/8"),
            ("LH_PUBLISH_URL", "http://hooks/effects/"),
            ("LH_PUBLISH_DEDUPES", "false"),
            ("LH_FETCH_MAX_BYTES", "2048"),
            ("LH_FETCH_TIMEOUT", "3s"),
            ("LH_TOOL_FAULTS", "publish:timeout_after_commit:2"),
        ]
        .into_iter()
        .collect();
        let c = ToolboxConfig::from_lookup(|k| env.get(k).map(|v| v.to_string())).unwrap();
        assert_eq!(c.search.url, "http://searx:8080");
        assert_eq!(c.fetch.allow.hosts, vec!["sim".to_string()]);
        assert_eq!(c.fetch.allow.nets.len(), 1);
        assert_eq!(c.publish.url, "http://hooks/effects");
        assert!(!c.publish.dedupes_by_key);
        assert_eq!(c.fetch.max_bytes, 2048);
        assert_eq!(c.fetch.timeout, Duration::from_secs(3));
        let tb = Toolbox::builtin(&c, None, Arc::new(crate::NoEvents)).unwrap();
        assert_eq!(
            tb.faults().take("publish"),
            Some(FaultMode::TimeoutAfterCommit)
        );

        let d = ToolboxConfig::from_lookup(|_| None).unwrap();
        assert_eq!(d.search.url, DEFAULT_BASE_URL);
        assert_eq!(d.publish.url, format!("{DEFAULT_BASE_URL}/effects"));
        assert!(d.fetch.allow.is_empty());

        for (k, v) in [
            ("LH_TOOL_FAULTS", "x:nope"),
            ("LH_FETCH_ALLOW", "10.0.0.0/99"),
            ("LH_PUBLISH_DEDUPES", "maybe"),
            ("LH_FETCH_TIMEOUT", "15"),
            ("LH_FETCH_TIMEOUT", "0s"),
            ("LH_FETCH_MAX_BYTES", "1MB"),
            ("LH_SEARCH_URL", "searx:8080"),
            ("LH_PUBLISH_URL", "file:///tmp/effects"),
            ("LH_PUBLISH_URL", "http://"),
        ] {
            let e = ToolboxConfig::from_lookup(|q| (q == k).then(|| v.to_string())).unwrap_err();
            assert!(e.to_string().contains(k), "{k}={v}: {e}");
        }
    }

    #[test]
    fn every_variable_read_is_listed() {
        let read = std::sync::Mutex::new(Vec::new());
        ToolboxConfig::from_lookup(|k| {
            read.lock().unwrap().push(k.to_string());
            None
        })
        .unwrap();
        let read = read.into_inner().unwrap();
        assert!(!read.is_empty());
        for k in read {
            assert!(
                ENV_VARS.iter().any(|(n, _)| *n == k),
                "{k} is not in ENV_VARS"
            );
        }
    }

    #[test]
    fn backoff_is_capped_with_full_jitter() {
        let p = RetryPolicy {
            max_attempts: 10,
            base: Duration::from_millis(100),
            cap: Duration::from_millis(300),
            deadline: Duration::from_secs(1),
        };
        for attempt in 1..10 {
            assert!(p.delay(attempt) <= Duration::from_millis(300));
        }
        assert!(p.delay(1) <= Duration::from_millis(200));
    }

    #[test]
    fn events_serialize_with_their_key() {
        let ev = ToolEvent {
            kind: ToolEventKind::Replayed,
            tool: "publish".into(),
            key: "k".into(),
            job_id: "j".into(),
            step_id: "s#1".into(),
            epoch: 2,
            at: "2026-11-30T00:00:00Z".into(),
            ok: Some(true),
            error: None,
            detail: None,
        };
        let v = serde_json::to_value(&ev).unwrap();
        assert_eq!(v["kind"], "replayed");
        assert_eq!(v["key"], "k");
        assert!(v.get("error").is_none());
    }
}
