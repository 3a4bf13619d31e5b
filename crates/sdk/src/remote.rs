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
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use leasehold_store::events::Events;
use leasehold_tools::{request_may_have_been_sent, EffectsLedger, NoEvents, Toolbox};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use tokio::sync::{Mutex, OnceCell};

use crate::journal::{Journal, Recorded};
use crate::{BoxFuture, Ctx, Error, ExecCtx, Kind, Reconcile, Tool, ToolError, ToolKind, ToolSpec};

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

/// Connection refusals are retried in the call at 200 ms, 400 ms, ... up
/// to this delay (3 s in all) before the attempt ends.
const CONNECT_RETRY_CAP: Duration = Duration::from_millis(1600);

/// How a worker reaches a remote kind's service.
///
/// ```
/// let cfg = leasehold::RemoteConfig::new("http://127.0.0.1:9000/").bearer("s3cret");
/// assert_eq!(cfg.url, "http://127.0.0.1:9000");
/// ```
#[derive(Clone)]
pub struct RemoteConfig {
    /// The service's base URL (no trailing slash): `POST {url}/invoke`,
    /// `POST {url}/tools/{name}`, `POST {url}/tools/{name}/find_existing`.
    pub url: String,
    /// Sent as `Authorization: Bearer <token>` with every request.
    pub token: Option<String>,
    /// Signs every request (`X-Leasehold-Signature: t=<unix>,n=<nonce>,v2=<hex>`,
    /// HMAC-SHA256 of `<t>.<nonce>.POST.<path>.<body>`: see [`signature`]).
    pub hmac_secret: Option<String>,
    /// The longest one call may take.
    pub timeout: Duration,
    /// Journal entries per call at most.
    pub page: usize,
    /// The largest request or answer body, in bytes.
    pub max_body: usize,
}

impl std::fmt::Debug for RemoteConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteConfig")
            .field("url", &self.url)
            .field("token", &self.token.as_ref().map(|_| "<set>"))
            .field("hmac_secret", &self.hmac_secret.as_ref().map(|_| "<set>"))
            .field("timeout", &self.timeout)
            .field("page", &self.page)
            .field("max_body", &self.max_body)
            .finish()
    }
}

impl RemoteConfig {
    /// A service at `url`, with the defaults (30 s per call, 256 journal
    /// entries per page, 1 MiB bodies) and no authentication.
    pub fn new(url: &str) -> RemoteConfig {
        RemoteConfig {
            url: url.trim_end_matches('/').to_string(),
            token: None,
            hmac_secret: None,
            timeout: Duration::from_secs(30),
            page: 256,
            max_body: 1 << 20,
        }
    }

    /// With a bearer token.
    pub fn bearer(mut self, token: &str) -> RemoteConfig {
        self.token = Some(token.to_string());
        self
    }

    /// With an HMAC-SHA256 signing secret.
    pub fn hmac(mut self, secret: &str) -> RemoteConfig {
        self.hmac_secret = Some(secret.to_string());
        self
    }

    /// The remote kinds of a worker's options (`--remote-kind NAME=URL`),
    /// with `LH_REMOTE_TOKEN` and `LH_REMOTE_HMAC_SECRET` from the
    /// environment, or the variables a kind names for itself
    /// (`NAME=URL;token=VAR;secret=VAR`).
    pub fn from_options(opts: &crate::Options) -> Result<Vec<(String, RemoteConfig)>, String> {
        Self::from_options_with(opts, |k| std::env::var(k).ok())
    }

    /// [`RemoteConfig::from_options`] reading variables with `var`.
    ///
    /// A kind's spec is `NAME=URL`, optionally followed by `;token=VAR`
    /// and `;secret=VAR`: the names of the environment variables holding
    /// that kind's bearer token and signing secret (the values are never
    /// on the command line). A kind that names none uses
    /// `LH_REMOTE_TOKEN` / `LH_REMOTE_HMAC_SECRET`; a named variable that
    /// is unset or empty is an error, not a kind served without it.
    ///
    /// ```
    /// let mut o = leasehold::Options::local("nats://127.0.0.1:4222", "lh");
    /// o.remote_kinds = vec!["invoice=http://a:9000/;secret=INVOICE_SECRET".into()];
    /// let kinds = leasehold::RemoteConfig::from_options_with(&o, |k| {
    ///     (k == "INVOICE_SECRET").then(|| "s3cret".to_string())
    /// })
    /// .unwrap();
    /// assert_eq!(kinds[0].1.hmac_secret.as_deref(), Some("s3cret"));
    /// ```
    pub fn from_options_with(
        opts: &crate::Options,
        var: impl Fn(&str) -> Option<String>,
    ) -> Result<Vec<(String, RemoteConfig)>, String> {
        let read = |k: &str| var(k).filter(|s| !s.is_empty());
        let token = read("LH_REMOTE_TOKEN");
        let secret = read("LH_REMOTE_HMAC_SECRET");
        let mut out = Vec::new();
        for spec in opts.remote_kinds.iter().filter(|s| !s.trim().is_empty()) {
            let (name, rest) = spec.split_once('=').ok_or_else(|| {
                format!("--remote-kind {spec:?}: expected NAME=URL, e.g. invoice=http://127.0.0.1:9000/")
            })?;
            let mut parts = rest.split(';');
            let (name, url) = (name.trim(), parts.next().unwrap_or("").trim());
            if name.is_empty() || !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(format!(
                    "--remote-kind {spec:?}: expected NAME=URL with an http(s) URL"
                ));
            }
            if opts.remote_journal_page == 0 {
                return Err("--remote-journal-page must be at least 1".into());
            }
            let mut cfg = RemoteConfig::new(url);
            cfg.token = token.clone();
            cfg.hmac_secret = secret.clone();
            for part in parts.map(str::trim).filter(|p| !p.is_empty()) {
                let (key, name_of_var) = part.split_once('=').unwrap_or((part, ""));
                let valid = !name_of_var.is_empty()
                    && name_of_var
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_');
                if !valid {
                    return Err(format!(
                        "--remote-kind {name}: `{part}` is not `token=VAR` or `secret=VAR` (VAR: the name of an environment variable)"
                    ));
                }
                let value = || {
                    read(name_of_var).ok_or_else(|| {
                        format!("--remote-kind {name}: {key}={name_of_var}, but {name_of_var} is not set (or empty)")
                    })
                };
                match key {
                    "token" => cfg.token = Some(value()?),
                    "secret" => cfg.hmac_secret = Some(value()?),
                    other => {
                        return Err(format!(
                        "--remote-kind {name}: unknown setting `{other}` (token=VAR, secret=VAR)"
                    ))
                    }
                }
            }
            cfg.timeout = opts.remote_timeout;
            cfg.page = opts.remote_journal_page;
            cfg.max_body = opts.remote_max_body;
            out.push((name.to_string(), cfg));
        }
        Ok(out)
    }
}

/// HMAC-SHA256 (RFC 2104) of `msg` under `key`.
pub fn hmac_sha256(key: &[u8], msg: &[u8]) -> [u8; 32] {
    let mut k = [0u8; 64];
    if key.len() > 64 {
        k[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        k[..key.len()].copy_from_slice(key);
    }
    let (mut ipad, mut opad) = ([0x36u8; 64], [0x5cu8; 64]);
    for i in 0..64 {
        ipad[i] ^= k[i];
        opad[i] ^= k[i];
    }
    let inner = Sha256::new()
        .chain_update(ipad)
        .chain_update(msg)
        .finalize();
    Sha256::new()
        .chain_update(opad)
        .chain_update(inner)
        .finalize()
        .into()
}

/// The signature header's value for one request at unix time `t`:
/// `t=<t>,n=<nonce>,v2=<hex>`, the HMAC-SHA256 of
/// `<t>.<nonce>.<METHOD>.<path>.<body>`. It binds the endpoint (a signed
/// call to one tool is not a call to another, nor to `find_existing`) and,
/// by its nonce (fresh for every request), one request: a service serves a
/// nonce once within the time tolerance.
///
/// ```
/// let h = leasehold::signature("s3cret", 1_700_000_000, "n1", "POST", "/invoke", b"{}");
/// assert!(h.starts_with("t=1700000000,n=n1,v2="));
/// ```
pub fn signature(
    secret: &str,
    t: u64,
    nonce: &str,
    method: &str,
    path: &str,
    body: &[u8],
) -> String {
    let mut msg = format!("{t}.{nonce}.{method}.{path}.").into_bytes();
    msg.extend_from_slice(body);
    format!(
        "t={t},n={nonce},v2={}",
        hex::encode(hmac_sha256(secret.as_bytes(), &msg))
    )
}

/// Why a call to the service gave no usable answer.
#[derive(Debug)]
enum CallError {
    /// The HTTP exchange failed (not reached, reset, timed out, a broken
    /// answer): worth another attempt. The client's error is kept, because
    /// its kind, not its text, says whether the request may have reached
    /// the service ([`leasehold_tools::request_may_have_been_sent`]).
    Http {
        error: reqwest::Error,
        timeout: Duration,
    },
    /// The service answered an HTTP error status without an error object:
    /// the request reached it.
    Status(u16),
    /// An answer that breaks the protocol (not JSON, wrong schema, too large).
    Protocol(String),
    /// The service's own error object (`{"error": {"code", "message"}}`).
    Service { code: String, message: String },
}

/// The HTTP side of the protocol: signed, bounded calls.
struct Client {
    cfg: RemoteConfig,
    http: reqwest::Client,
}

impl Client {
    async fn post(&self, path: &str, body: &Value, timeout: Duration) -> Result<Value, CallError> {
        let body = serde_json::to_vec(body).map_err(|e| CallError::Protocol(e.to_string()))?;
        if body.len() > self.cfg.max_body {
            return Err(CallError::Protocol(format!(
                "request_too_large: the request is {} bytes, the limit {} (LH_REMOTE_MAX_BODY)",
                body.len(),
                self.cfg.max_body
            )));
        }
        let url = format!("{}{path}", self.cfg.url);
        let mut req = self
            .http
            .post(&url)
            .timeout(timeout)
            .header("content-type", "application/json")
            .header("x-leasehold-protocol", PROTOCOL.to_string());
        if let Some(t) = &self.cfg.token {
            req = req.bearer_auth(t);
        }
        if let Some(s) = &self.cfg.hmac_secret {
            let t = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0);
            // The path as the service reads it (the base URL's own path
            // included), so the signature binds the endpoint.
            let signed_path = reqwest::Url::parse(&url)
                .map(|u| u.path().to_string())
                .unwrap_or_else(|_| path.to_string());
            let nonce = uuid::Uuid::new_v4().simple().to_string();
            req = req.header(
                SIGNATURE_HEADER,
                signature(s, t, &nonce, "POST", &signed_path, &body),
            );
        }
        // A request that was certainly never sent (a connection refused)
        // never reached the service: safe to try again at once (a service
        // restarting), a few times, before the attempt ends. Anything after
        // a byte may have left goes back to the caller, which reconciles.
        let mut backoff = Duration::from_millis(200);
        let mut resp = loop {
            let Some(r) = req.try_clone() else {
                break req.body(body).send().await;
            };
            match r.body(body.clone()).send().await {
                Err(e) if !request_may_have_been_sent(&e) && backoff <= CONNECT_RETRY_CAP => {
                    tokio::time::sleep(backoff).await;
                    backoff *= 2;
                }
                r => break r,
            }
        }
        .map_err(|error| CallError::Http { error, timeout })?;
        let status = resp.status().as_u16();
        let mut buf: Vec<u8> = Vec::new();
        loop {
            match resp.chunk().await {
                Ok(Some(c)) => {
                    buf.extend_from_slice(&c);
                    if buf.len() > self.cfg.max_body {
                        return Err(CallError::Protocol(format!(
                            "answer_too_large: the answer is over the limit of {} bytes (LH_REMOTE_MAX_BODY)",
                            self.cfg.max_body
                        )));
                    }
                }
                Ok(None) => break,
                Err(error) => return Err(CallError::Http { error, timeout }),
            }
        }
        let v: Value = serde_json::from_slice(&buf).map_err(|e| {
            let head = String::from_utf8_lossy(&buf[..buf.len().min(120)]).to_string();
            CallError::Protocol(format!(
                "not_json: the answer (HTTP {status}) is not JSON ({e}): {head:?}"
            ))
        })?;
        if let Some(err) = v.get("error").filter(|e| e.is_object()) {
            return Err(CallError::Service {
                code: err["code"].as_str().unwrap_or("unknown").to_string(),
                message: err["message"].as_str().unwrap_or("").to_string(),
            });
        }
        if !(200..300).contains(&status) {
            return Err(CallError::Status(status));
        }
        match v.get("protocol").and_then(Value::as_u64) {
            Some(PROTOCOL) => Ok(v),
            Some(p) => Err(CallError::Protocol(format!(
                "unsupported_protocol: the service answered with protocol {p}, this worker speaks {PROTOCOL}"
            ))),
            None => Err(CallError::Protocol(
                "bad_answer: the answer has no `protocol` field".into(),
            )),
        }
    }
}

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
                "step" => {
                    if op.get("result").is_none() {
                        return Err(protocol("bad_answer: a `step` op needs `result`"));
                    }
                    idle = 0;
                    if let Some((index, id)) = position(&op, &entries)? {
                        let rec = Recorded {
                            index,
                            id,
                            version,
                            result: op["result"].clone(),
                        };
                        self.record(ctx, &mut entries, rec).await?;
                    }
                }
                "effect" => {
                    idle = 0;
                    if let Some((index, id)) = position(&op, &entries)? {
                        let result = self.effect(ctx, &id, &op).await?;
                        let rec = Recorded {
                            index,
                            id,
                            version,
                            result,
                        };
                        self.record(ctx, &mut entries, rec).await?;
                    }
                }
                "generate" => {
                    idle = 0;
                    if let Some((index, id)) = position(&op, &entries)? {
                        let result = self.generate(ctx, &id, &op).await?;
                        let rec = Recorded {
                            index,
                            id,
                            version,
                            result,
                        };
                        self.record(ctx, &mut entries, rec).await?;
                    }
                }
                "park" => {
                    idle = 0;
                    if let Some((index, id)) = position(&op, &entries)? {
                        let reason = op["reason"].as_str().unwrap_or("approval");
                        let question = op["question"].as_str().unwrap_or("");
                        // Only an answer naming this step, given after
                        // its own park, is this park's.
                        match crate::ctx::answer_for(ctx.job(), &id).await? {
                            Some(answer) => {
                                let rec = Recorded {
                                    index,
                                    id,
                                    version,
                                    result: answer,
                                };
                                self.record(ctx, &mut entries, rec).await?;
                            }
                            None => return Err(ctx.park_at(&id, reason, question)),
                        }
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
                        "unknown_op: `{other}` (this worker knows step, effect, generate, park, journal, complete, fail, retry, journal_mismatch)"
                    )))
                }
            }
        }
    }
}

/// A write tool of the service, run through the ledger: `POST
/// {url}/tools/{name}` with the idempotency key; `find_existing` at `POST
/// {url}/tools/{name}/find_existing`.
struct RemoteTool {
    spec: ToolSpec,
    client: Arc<Client>,
    /// The effect op said its destination deduplicates by the idempotency
    /// key: after `not_found`, calling again cannot repeat the effect.
    dedupes: bool,
    /// The remote kind whose service named the tool: its business keys are
    /// its own (another kind's service never sees, nor suppresses, them).
    kind: String,
    /// The call's arguments are an effect's `{"args", "business_key"}`;
    /// otherwise (a tool the model calls in a `generate`) the model's
    /// arguments themselves, with no business key.
    wrapped: bool,
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

fn tool_error(e: CallError) -> ToolError {
    match e {
        // The one rule for "may the request have been sent" decides.
        CallError::Http { error, timeout } => ToolError::from_reqwest(error, timeout),
        CallError::Status(status) => ToolError::Transport(format!(
            "the service answered HTTP {status} without an error object"
        )),
        CallError::Protocol(m) => ToolError::BadResponse(m),
        CallError::Service { code, message } => ToolError::Upstream {
            status: match code.as_str() {
                "terminal" => 400,
                "conflict" => 409,
                _ => 503,
            },
            message: format!("{code}: {message}"),
        },
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

#[cfg(test)]
mod tests {
    #[test]
    fn a_kind_may_name_its_own_token_and_secret_variables() {
        let mut o = crate::Options::local("nats://127.0.0.1:4222", "lh");
        o.remote_kinds = vec![
            "a=http://a:1/;token=A_TOKEN;secret=A_SECRET".into(),
            "b=http://b:2/ ; secret=B_SECRET".into(),
            "c=http://c:3/".into(),
        ];
        let env = |k: &str| {
            match k {
                "A_TOKEN" => Some("ta"),
                "A_SECRET" => Some("value-of-a-secret"),
                "B_SECRET" => Some("sb"),
                "LH_REMOTE_TOKEN" => Some("t-default"),
                "LH_REMOTE_HMAC_SECRET" => Some("s-default"),
                "EMPTY" => Some(""),
                _ => None,
            }
            .map(String::from)
        };
        let kinds = RemoteConfig::from_options_with(&o, env).unwrap();
        let got: Vec<(&str, &str, Option<&str>, Option<&str>)> = kinds
            .iter()
            .map(|(n, c)| {
                (
                    n.as_str(),
                    c.url.as_str(),
                    c.token.as_deref(),
                    c.hmac_secret.as_deref(),
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                ("a", "http://a:1", Some("ta"), Some("value-of-a-secret")),
                ("b", "http://b:2", Some("t-default"), Some("sb")),
                ("c", "http://c:3", Some("t-default"), Some("s-default")),
            ]
        );
        for (spec, why) in [
            ("a=http://a:1/;secret=UNSET", "UNSET is not set"),
            ("a=http://a:1/;secret=EMPTY", "EMPTY is not set"),
            (
                "a=http://a:1/;password=A_SECRET",
                "unknown setting `password`",
            ),
            (
                "a=http://a:1/;secret=",
                "is not `token=VAR` or `secret=VAR`",
            ),
            ("a=http://a:1/;secret=$A_SECRET", "is not `token=VAR`"),
            ("a=http://a:1/;token", "is not `token=VAR`"),
        ] {
            o.remote_kinds = vec![spec.into()];
            let e = RemoteConfig::from_options_with(&o, env).unwrap_err();
            assert!(e.contains(why), "{spec}: {e}");
            assert!(!e.contains("value-of"), "no secret in the message: {e}");
        }
    }

    use super::*;

    #[test]
    fn hmac_matches_rfc_4231() {
        assert_eq!(
            hex::encode(hmac_sha256(b"Jefe", b"what do ya want for nothing?")),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        let long = [0xaau8; 131];
        assert_eq!(
            hex::encode(hmac_sha256(
                &long,
                b"Test Using Larger Than Block-Size Key - Hash Key First"
            )),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"
        );
    }

    #[test]
    fn the_toolbox_cache_stays_bounded() {
        let mut m = BTreeMap::new();
        for i in 0..1000 {
            insert_bounded(&mut m, format!("tool-{i:04}"), i, 256);
        }
        assert_eq!(m.len(), 256);
        assert_eq!(m.get("tool-0999"), Some(&999), "the newest is kept");
    }

    fn rec(i: usize, id: &str, v: Value) -> Recorded {
        Recorded {
            index: i,
            id: id.into(),
            version: "1".into(),
            result: v,
        }
    }

    #[test]
    fn a_recording_op_is_checked_against_the_journal() {
        let j = vec![rec(0, "a#0", json!(1))];
        let op =
            |i: u64, id: &str, r: Value| json!({"op": "step", "index": i, "id": id, "result": r});
        assert_eq!(
            position(&op(1, "b#0", json!(2)), &j).unwrap(),
            Some((1, "b#0".into()))
        );
        assert_eq!(position(&op(0, "a#0", json!(1)), &j).unwrap(), None);
        let e = position(&op(0, "a#0", json!(9)), &j).unwrap_err();
        assert!(
            matches!(&e, Error::Park { reason, message } if reason == "protocol_error" && message.contains("step_conflict")),
            "{e:?}"
        );
        let e = position(&op(0, "x#0", json!(1)), &j).unwrap_err();
        assert!(
            matches!(&e, Error::Park { reason, .. } if reason == "journal_mismatch"),
            "{e:?}"
        );
        assert!(matches!(
            position(&op(5, "b#0", json!(1)), &j),
            Err(Error::Retryable(_))
        ));
        assert!(matches!(
            position(&op(1, "nohash", json!(1)), &j),
            Err(Error::Retryable(_))
        ));
    }
}
