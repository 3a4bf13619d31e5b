//! [`RemoteKind`]: a kind served by an HTTP service in any language,
//! through the worker protocol (`docs/protocol.md`, schemas under
//! `proto/worker-protocol/v1/`).
//!
//! The worker holds the job and does every write; the service only says
//! what to record next. Each call sends the job and the part of its step
//! journal the service has not seen yet; the service replays its function
//! against the journal and answers with one op: a `step` to record, an
//! `effect` the worker runs through the effects ledger (calling the
//! service's tool endpoint with the idempotency key, reconciling with its
//! `find_existing` endpoint), a `park` for a person, `journal` (send me
//! entries from here), or an end (`complete`, `fail`, `retry`,
//! `journal_mismatch`). Every record is a fenced event of this attempt, so a
//! service answering for a stale attempt changes nothing.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use leasehold_store::events::Events;
use leasehold_tools::{EffectsLedger, NoEvents, Toolbox};
use serde_json::{json, Value};
use tokio::sync::{Mutex, OnceCell};

use crate::journal::{Journal, Recorded};
use crate::{Ctx, Error, Kind, ToolKind, ToolSpec};

mod client;
mod config;
#[cfg(test)]
mod tests;
mod tool;

use client::{tool_error, CallError, Client};
use tool::RemoteTool;

pub use client::{hmac_sha256, signature};
pub use config::RemoteConfig;

/// The protocol version this worker speaks.
pub const PROTOCOL: u64 = 1;

/// The header carrying the HMAC-SHA256 signature of a request ([`signature`]).
pub const SIGNATURE_HEADER: &str = "X-Leasehold-Signature";

/// Calls to the service that record nothing (journal pages) allowed in a
/// row before the attempt gives up: a service asking for pages forever.
const MAX_IDLE_CALLS: usize = 64;

/// Toolboxes (one per tool name and settings a service named) kept at
/// most: a service naming tools per job must not grow the worker for ever.
const MAX_TOOLBOXES: usize = 256;

/// A kind served by an HTTP service through the worker protocol. The
/// worker runs it with the same step journal, effects ledger, fencing and
/// park/answer machinery as a Rust kind.
///
/// ```no_run
/// # async fn f() -> anyhow::Result<()> {
/// use leasehold::{RemoteConfig, RemoteKind, Worker};
/// Worker::from_env()
///     .kind("invoice", RemoteKind::new(RemoteConfig::new("http://127.0.0.1:9000/")))
///     .run()
///     .await
/// # }
/// ```
pub struct RemoteKind {
    client: Arc<Client>,
    ledger: OnceCell<EffectsLedger>,
    /// One toolbox per tool the service named (and its settings), each
    /// with its one tool.
    toolboxes: Mutex<BTreeMap<String, Arc<Toolbox>>>,
}

impl RemoteKind {
    /// The kind served at `cfg.url`.
    pub fn new(cfg: RemoteConfig) -> RemoteKind {
        RemoteKind {
            client: Arc::new(Client {
                cfg,
                http: reqwest::Client::new(),
            }),
            ledger: OnceCell::new(),
            toolboxes: Mutex::new(BTreeMap::new()),
        }
    }

    async fn toolbox(
        &self,
        ctx: &Ctx,
        tool: &str,
        timeout: Duration,
        dedupes: bool,
    ) -> Result<Arc<Toolbox>, Error> {
        let ledger = self
            .ledger
            .get_or_try_init(|| ctx.effects_ledger())
            .await?
            .clone();
        let mut g = self.toolboxes.lock().await;
        let name = format!("{tool}/{dedupes}/{}", timeout.as_millis());
        if let Some(tb) = g.get(&name) {
            return Ok(tb.clone());
        }
        let mut tb = Toolbox::new(Some(ledger), Arc::new(NoEvents));
        tb.register(Arc::new(RemoteTool {
            spec: ToolSpec {
                name: tool.to_string(),
                description: format!("`{tool}` of the remote kind's service"),
                kind: ToolKind::Write,
                schema: json!({"type": "object", "required": ["args"]}),
                timeout,
            },
            client: self.client.clone(),
            dedupes,
            kind: ctx.kind().to_string(),
            wrapped: true,
        }))
        .map_err(|e| Error::terminal(format!("tool `{tool}`: {e}")))?;
        let tb = Arc::new(tb);
        insert_bounded(&mut g, name, tb.clone(), MAX_TOOLBOXES);
        Ok(tb)
    }

    /// The job's recorded steps.
    async fn load(&self, ctx: &Ctx) -> Result<Vec<Recorded>, Error> {
        // The first claim (epoch 1): nobody else can have recorded a step
        // (every record is fenced by its claim), so nothing to read.
        if ctx.epoch() <= 1 {
            return Ok(Vec::new());
        }
        let events = Events::new(&ctx.job().conn)
            .read_types(ctx.id(), &["step"])
            .await
            .map_err(|e| Error::retryable(format!("reading the job's steps: {e}")))?;
        Ok(Journal::new(
            events
                .iter()
                .filter_map(|(_, ev)| Recorded::of(&ev.data_map())),
        )
        .into_recorded())
    }

    /// The invoke request with the journal from `from` (one page, bounded
    /// by entries and by bytes).
    fn request(&self, ctx: &Ctx, entries: &[Recorded], from: usize) -> (Value, usize) {
        let rec = ctx.record();
        let job = json!({
            "id": rec.id,
            "kind": rec.kind,
            "input": ctx.input_json(),
            "epoch": rec.epoch,
            "attempt": rec.attempts + 1,
            "deadline": rec.lease_expires_at,
        });
        let budget = self.client.cfg.max_body / 2;
        let mut bytes = job.to_string().len();
        let mut page = Vec::new();
        let mut end = from.min(entries.len());
        while end < entries.len() && page.len() < self.client.cfg.page {
            let e = &entries[end];
            let v = json!({"index": e.index, "id": e.id, "result": e.result});
            let n = v.to_string().len();
            if !page.is_empty() && bytes + n > budget {
                break;
            }
            bytes += n;
            page.push(v);
            end += 1;
        }
        let next = (end < entries.len()).then_some(end);
        (
            json!({
                "protocol": PROTOCOL,
                "type": "invoke",
                "job": job,
                "journal": {"from": from, "total": entries.len(), "entries": page, "next_cursor": next},
            }),
            end,
        )
    }

    async fn record(
        &self,
        ctx: &Ctx,
        entries: &mut Vec<Recorded>,
        rec: Recorded,
    ) -> Result<(), Error> {
        // A step that could never be sent back to the service (the job and
        // this one entry over the body limit) would make every later call
        // `request_too_large`: it is not recorded, and a person decides.
        let (one, _) = self.request(ctx, std::slice::from_ref(&rec), 0);
        let bytes = one.to_string().len();
        if bytes > self.client.cfg.max_body {
            return Err(Error::park(
                "protocol_error",
                format!(
                    "step_too_large: step `{}` with its job is {bytes} bytes, over what one call may carry ({} bytes, LH_REMOTE_MAX_BODY); it is not recorded: raise the limit and `leasehold review resume` the job, or end it with `leasehold review fail`",
                    rec.id, self.client.cfg.max_body
                ),
            ));
        }
        crate::ctx::record_step(ctx.job(), &rec).await?;
        entries.push(rec);
        Ok(())
    }

    /// The result that an op which records a step (`kind`) records as
    /// step `id`, once the worker did its part: a `step`'s own result, a
    /// write through the ledger, a model conversation, a person's answer, a
    /// timer's or a signal's wait (the last three end the attempt instead
    /// when there is nothing to record yet).
    async fn result_of(
        &self,
        ctx: &Ctx,
        kind: &str,
        id: &str,
        op: &Value,
        entries: &[Recorded],
    ) -> Result<Value, Error> {
        match kind {
            "step" => Ok(op["result"].clone()),
            "effect" => self.effect(ctx, id, op).await,
            "generate" => self.generate(ctx, id, op).await,
            // Only an answer naming this step, given after its own park,
            // is this park's.
            "park" => match crate::ctx::answer_for(ctx.job(), id).await? {
                Some(answer) => Ok(answer),
                None => Err(ctx.park_at(
                    id,
                    op["reason"].as_str().unwrap_or("approval"),
                    op["question"].as_str().unwrap_or(""),
                )),
            },
            "sleep" => {
                let due = sleep_due(op)?;
                Ok(Value::String(crate::ctx::timer(
                    &ctx.job().record,
                    id,
                    due,
                )?))
            }
            "wait_for" => {
                let (name, timeout) = wait_for_op(op, id)?;
                let after = crate::ctx::signal_taken(entries, &name);
                crate::ctx::signal_wait(ctx.job(), id, &name, after, timeout).await
            }
            "spawn" => {
                let (kind, inputs, opts) = spawn_op(op, id)?;
                crate::ctx::spawn_children(ctx.job(), id, &kind, &inputs, opts).await
            }
            "join" => {
                let children = join_op(op, id)?;
                let mine = crate::ctx::spawned(entries);
                crate::ctx::join_children(ctx.job(), id, &children, &mine).await
            }
            other => unreachable!("`{other}` records no step"),
        }
    }

    /// Runs a `generate` op: one model conversation with the worker's agent
    /// runtime, its transcript journaled under the step, offered the
    /// service's tools the op names (reads called directly, writes through
    /// the ledger as an effect).
    async fn generate(&self, ctx: &Ctx, id: &str, op: &Value) -> Result<Value, Error> {
        let prompt = op["prompt"]
            .as_str()
            .ok_or_else(|| protocol("bad_answer: a `generate` op needs `prompt` (string)"))?;
        let model = op["model"].as_str().unwrap_or("main");
        let generator = ctx.generator(model)?;
        let mut spec = crate::Agent::new(model, op["system"].as_str().unwrap_or(""), prompt);
        if let Some(schema) = op.get("schema").filter(|s| s.is_object()) {
            spec = spec.schema(schema.clone());
        }
        let toolbox = match op.get("tools").filter(|t| !t.is_null()) {
            Some(tools) => {
                let (tb, names) = self.model_tools(ctx, tools).await?;
                spec.tools = names;
                Some(tb)
            }
            None => None,
        };
        let out = tokio::select! {
            r = crate::agent::run(ctx.job(), ctx.threads(), id, generator, toolbox, &spec) => r?,
            _ = ctx.cancelled().cancelled() => return Err(Error::Cancelled),
        };
        Ok(json!({"text": out.text, "json": out.json, "model_calls": out.model_calls}))
    }

    /// The toolbox of a `generate` op's `tools`: `[{name, kind: read|write,
    /// description?, schema?, timeout_ms?, dedupes_by_key?}]`, each a tool
    /// of the service the model may call.
    async fn model_tools(
        &self,
        ctx: &Ctx,
        tools: &Value,
    ) -> Result<(Arc<Toolbox>, Vec<String>), Error> {
        let list = tools
            .as_array()
            .ok_or_else(|| protocol("bad_answer: a `generate` op's `tools` is a list"))?;
        let writes = list.iter().any(|t| t["kind"] == "write");
        let ledger = if writes {
            Some(
                self.ledger
                    .get_or_try_init(|| ctx.effects_ledger())
                    .await?
                    .clone(),
            )
        } else {
            None
        };
        let mut tb = Toolbox::new(ledger, Arc::new(NoEvents));
        let mut names = Vec::new();
        for t in list {
            let name = t["name"]
                .as_str()
                .filter(|n| !n.is_empty() && !n.contains('/'))
                .ok_or_else(|| protocol("bad_answer: a generate tool needs a `name` (no `/`)"))?;
            let kind = match t["kind"].as_str() {
                Some("read") => ToolKind::Read,
                Some("write") => ToolKind::Write,
                other => {
                    return Err(protocol(format!(
                        "bad_answer: generate tool `{name}`: `kind` is {other:?}, not read or write"
                    )))
                }
            };
            let schema = match t.get("schema") {
                None | Some(Value::Null) => json!({"type": "object"}),
                Some(s) if s.is_object() => s.clone(),
                Some(_) => {
                    return Err(protocol(format!(
                        "bad_answer: generate tool `{name}`: `schema` is not an object"
                    )))
                }
            };
            let timeout = t["timeout_ms"]
                .as_u64()
                .map(Duration::from_millis)
                .unwrap_or(Duration::from_secs(10))
                .min(self.client.cfg.timeout);
            tb.register(Arc::new(RemoteTool {
                spec: ToolSpec {
                    name: name.to_string(),
                    description: t["description"]
                        .as_str()
                        .map(String::from)
                        .unwrap_or_else(|| format!("`{name}` of the remote kind's service")),
                    kind,
                    schema,
                    timeout,
                },
                client: self.client.clone(),
                dedupes: t["dedupes_by_key"].as_bool().unwrap_or(false),
                kind: ctx.kind().to_string(),
                wrapped: false,
            }))
            .map_err(|e| protocol(format!("bad_answer: generate tool `{name}`: {e}")))?;
            names.push(name.to_string());
        }
        Ok((Arc::new(tb), names))
    }

    /// Runs an `effect` op's tool call through the ledger.
    async fn effect(&self, ctx: &Ctx, id: &str, op: &Value) -> Result<Value, Error> {
        let tool = op["tool"]
            .as_str()
            .filter(|t| !t.is_empty() && !t.contains('/'))
            .ok_or_else(|| protocol("bad_answer: an effect needs a `tool` name (no `/`)"))?;
        let timeout = op["timeout_ms"]
            .as_u64()
            .map(Duration::from_millis)
            .unwrap_or(Duration::from_secs(10))
            .min(self.client.cfg.timeout);
        let dedupes = op["dedupes_by_key"].as_bool().unwrap_or(false);
        let tb = self.toolbox(ctx, tool, timeout, dedupes).await?;
        let args = json!({"args": op["args"], "business_key": op["business_key"]});
        tokio::select! {
            r = crate::ctx::call_tool(ctx.job(), &tb, id, tool, &args) => r,
            _ = ctx.cancelled().cancelled() => Err(Error::Cancelled),
        }
    }
}

/// Inserts into a map kept at `cap` entries at most (the smallest key
/// leaves first: any one will do, a removed toolbox is made again).
fn insert_bounded<K: Ord, V>(map: &mut BTreeMap<K, V>, k: K, v: V, cap: usize) {
    while map.len() >= cap.max(1) {
        map.pop_first();
    }
    map.insert(k, v);
}

fn protocol(m: impl Into<String>) -> Error {
    Error::retryable(format!("protocol_error: {}", m.into()))
}

/// The `index` and `id` of a recording op, checked against the journal.
/// `Ok(None)`: the same step recorded again with the same result (a
/// duplicate answer), nothing to write.
fn position(op: &Value, entries: &[Recorded]) -> Result<Option<(usize, String)>, Error> {
    let kind = op["op"].as_str().unwrap_or("");
    let (Some(index), Some(id)) = (op["index"].as_u64(), op["id"].as_str()) else {
        return Err(protocol(format!(
            "bad_answer: a `{kind}` op needs `index` (integer) and `id` (string)"
        )));
    };
    let index = index as usize;
    if id.is_empty() || !id.contains('#') {
        return Err(protocol(format!(
            "bad_answer: step id {id:?} is not `<name>#<occurrence>`"
        )));
    }
    if let Some(r) = entries.get(index) {
        if r.id != id {
            return Err(Error::park(
                "journal_mismatch",
                format!("journal mismatch at step {index}: the recorded run has `{}`, the service now asks for `{id}`: the service's code changed while the job ran; restore the code and `leasehold review resume` the job, or end it with `leasehold review fail`", r.id),
            ));
        }
        if kind == "step" && r.result != op["result"] {
            return Err(Error::park(
                "protocol_error",
                format!("step_conflict: the service recorded step `{id}` again with another result (recorded {}, now {}); a step is recorded once: the service must replay it from the journal", r.result, op["result"]),
            ));
        }
        return Ok(None);
    }
    if index != entries.len() {
        return Err(protocol(format!(
            "bad_answer: step `{id}` at index {index}, but the journal has {} entries",
            entries.len()
        )));
    }
    if entries.iter().any(|r| r.id == id) {
        return Err(Error::park(
            "protocol_error",
            format!("step_conflict: step id `{id}` is already recorded at another index"),
        ));
    }
    Ok(Some((index, id.to_string())))
}

#[crate::async_trait]
impl Kind for RemoteKind {
    fn version(&self) -> &str {
        "remote"
    }

    async fn run(&self, ctx: &Ctx) -> Result<Value, Error> {
        let mut entries = self.load(ctx).await?;
        // What the service has of the journal (assumed after each answer).
        let mut sent = 0usize;
        let mut idle = 0usize;
        loop {
            let (req, end) = self.request(ctx, &entries, sent);
            let answer = tokio::select! {
                r = self.client.post("/invoke", &req, self.client.cfg.timeout) => r,
                _ = ctx.cancelled().cancelled() => return Err(Error::Cancelled),
            };
            let op = match answer {
                Ok(v) => v,
                Err(e @ (CallError::Http { .. } | CallError::Status(_))) => {
                    return Err(Error::retryable(format!("the service: {}", tool_error(e))))
                }
                Err(CallError::Protocol(m)) => return Err(protocol(m)),
                Err(CallError::Service { code, message }) => {
                    return Err(match code.as_str() {
                        "unsupported_protocol" => Error::terminal(format!(
                            "unsupported_protocol: the service does not speak protocol {PROTOCOL}: {message}"
                        )),
                        "unauthorized" => Error::terminal(format!("unauthorized: {message}")),
                        "unknown_kind" => Error::terminal(format!("unknown_kind: {message}")),
                        _ => Error::retryable(format!("service error `{code}`: {message}")),
                    })
                }
            };
            sent = end;
            let version = op["version"].as_str().unwrap_or("remote").to_string();
            match op["op"].as_str().unwrap_or("") {
                "journal" => {
                    idle += 1;
                    if idle > MAX_IDLE_CALLS {
                        return Err(protocol("the service asked for journal pages without end"));
                    }
                    let from = op["from"].as_u64().ok_or_else(|| {
                        protocol("bad_answer: a `journal` op needs `from` (integer)")
                    })? as usize;
                    if from > entries.len() {
                        return Err(protocol(format!(
                            "bad_answer: journal from {from}, but it has {} entries",
                            entries.len()
                        )));
                    }
                    tracing::info!(
                        job = %ctx.id(),
                        from,
                        total = entries.len(),
                        "remote kind: the service asked for the journal from {from}"
                    );
                    sent = from;
                }
                kind @ ("step" | "effect" | "generate" | "park" | "sleep" | "wait_for"
                | "spawn" | "join") => {
                    if kind == "step" && op.get("result").is_none() {
                        return Err(protocol("bad_answer: a `step` op needs `result`"));
                    }
                    idle = 0;
                    // A duplicate of a recorded step records nothing.
                    if let Some((index, id)) = position(&op, &entries)? {
                        // A journal check stops at the first op past the
                        // journal, before it does anything.
                        if ctx.is_dry() {
                            return Err(ctx.dry_stop(&id));
                        }
                        let result = self.result_of(ctx, kind, &id, &op, &entries).await?;
                        let rec = Recorded {
                            index,
                            id,
                            version,
                            result,
                        };
                        self.record(ctx, &mut entries, rec).await?;
                    }
                }
                "complete" => return Ok(op.get("output").cloned().unwrap_or(Value::Null)),
                "fail" => {
                    return Err(Error::terminal(
                        op["message"].as_str().unwrap_or("failed by the service"),
                    ))
                }
                "retry" => {
                    // The attempt ends now; the job waits queued for the
                    // delay (no slot held), up to the longest delay a job
                    // may have.
                    let delay = Duration::from_millis(op["delay_ms"].as_u64().unwrap_or(0))
                        .min(leasehold_core::spec::MAX_DELAY);
                    return Err(Error::retry_after(
                        op["message"].as_str().unwrap_or("retry asked by the service"),
                        delay,
                    ));
                }
                "journal_mismatch" => {
                    return Err(Error::park(
                        "journal_mismatch",
                        op["message"].as_str().unwrap_or("the service's code changed while the job ran"),
                    ))
                }
                "" => return Err(protocol("bad_answer: the answer has no `op`")),
                other => {
                    return Err(protocol(format!(
                        "unknown_op: `{other}` (this worker knows step, effect, generate, park, sleep, wait_for, spawn, join, journal, complete, fail, retry, journal_mismatch)"
                    )))
                }
            }
        }
    }
}

/// When a `sleep` op's first wait ends: `ms` from now, or the time `until`
/// (RFC 3339); exactly one of them. A bad op is a protocol error, never a
/// guessed wait.
/// A `wait_for` op's signal name and timeout; its step id must be a wait
/// for that name (`wait:<name>#n`).
fn wait_for_op(op: &Value, id: &str) -> Result<(String, Option<Duration>), Error> {
    let name = op["name"]
        .as_str()
        .ok_or_else(|| protocol("bad_answer: a `wait_for` op needs `name` (a string)"))?;
    if !leasehold_core::spec::valid_signal_name(name) {
        return Err(protocol(format!(
            "bad_answer: a `wait_for` op's `name` {name:?} is not a signal name ({})",
            leasehold_core::spec::SIGNAL_NAME_RULE
        )));
    }
    let prefix = format!("wait:{name}#");
    if !id.starts_with(&prefix) {
        return Err(protocol(format!(
            "bad_answer: a `wait_for` op for `{name}` has step id `{id}`; it must be `{prefix}<n>`"
        )));
    }
    let timeout = match op.get("timeout_ms") {
        None | Some(Value::Null) => None,
        Some(v) => Some(Duration::from_millis(v.as_u64().ok_or_else(|| {
            protocol("bad_answer: a `wait_for` op's `timeout_ms` is a whole number of milliseconds")
        })?)),
    };
    Ok((name.to_string(), timeout))
}

/// A `spawn` op's kind, inputs and options; its step id must be a spawn
/// of that kind (`spawn:<kind>#n`).
fn spawn_op(op: &Value, id: &str) -> Result<(String, Vec<Value>, crate::SpawnOptions), Error> {
    let kind = op["kind"]
        .as_str()
        .ok_or_else(|| protocol("bad_answer: a `spawn` op needs `kind` (a string)"))?;
    let prefix = format!("spawn:{kind}#");
    if !id.starts_with(&prefix) {
        return Err(protocol(format!(
            "bad_answer: a `spawn` op of kind `{kind}` has step id `{id}`; it must be `{prefix}<n>`"
        )));
    }
    let inputs = op["inputs"]
        .as_array()
        .filter(|l| l.iter().all(Value::is_object))
        .ok_or_else(|| {
            protocol("bad_answer: a `spawn` op needs `inputs`, a list of JSON objects")
        })?;
    let detach = match op.get("on_cancel").and_then(Value::as_str) {
        None | Some("cascade") => false,
        Some("detach") => true,
        Some(other) => {
            return Err(protocol(format!(
                "bad_answer: a `spawn` op's `on_cancel` is `cascade` or `detach`, not {other:?}"
            )))
        }
    };
    Ok((
        kind.to_string(),
        inputs.clone(),
        crate::SpawnOptions { detach },
    ))
}

/// A `join` op's children (ids); its step id must be a join (`join#n`).
fn join_op(op: &Value, id: &str) -> Result<Vec<String>, Error> {
    if !id.starts_with("join#") {
        return Err(protocol(format!(
            "bad_answer: a `join` op has step id `{id}`; it must be `join#<n>`"
        )));
    }
    op["children"]
        .as_array()
        .and_then(|l| {
            l.iter()
                .map(|c| c.as_str().filter(|s| leasehold_core::spec::valid_job_id(s)).map(String::from))
                .collect::<Option<Vec<_>>>()
        })
        .filter(|l| !l.is_empty())
        .ok_or_else(|| protocol("bad_answer: a `join` op needs `children`, a non-empty list of job ids (what its `spawn` steps returned)"))
}

fn sleep_due(op: &Value) -> Result<Box<dyn FnOnce(SystemTime) -> SystemTime + Send>, Error> {
    match (op.get("ms"), op.get("until")) {
        (Some(ms), None) => {
            let d = Duration::from_millis(ms.as_u64().ok_or_else(|| {
                protocol("bad_answer: a `sleep` op's `ms` is a whole number of milliseconds")
            })?);
            Ok(Box::new(move |now| now + d))
        }
        (None, Some(t)) => {
            let at = t
                .as_str()
                .and_then(leasehold_core::time::parse_rfc3339)
                .ok_or_else(|| {
                    protocol("bad_answer: a `sleep` op's `until` is an RFC 3339 time")
                })?;
            Ok(Box::new(move |_| at))
        }
        _ => Err(protocol(
            "bad_answer: a `sleep` op needs exactly one of `ms` and `until`",
        )),
    }
}
