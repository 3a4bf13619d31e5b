#![warn(missing_docs)]
//! `leasehold`: run your own agent jobs on a leasehold fleet.
//!
//! A *kind* is your code for one type of job ([`Kind`]). You build your own
//! worker binary: register kinds and tools on a [`Worker`], start it, and
//! every job of those kinds gets what leasehold gives its own workloads:
//! one owner at a time (a worker that wakes after losing a job can never
//! advance it), durable steps that a resumed attempt does not run again
//! ([`Ctx::step`]), tool calls whose side effects happen once ever through
//! the effects ledger ([`Ctx::call`]), people in the loop
//! ([`Ctx::park`]), job-level retries with backoff, dead letters, and the
//! CLI to watch it all (`leasehold watch ID`).
//!
//! ```no_run
//! use leasehold::{Ctx, Error, Kind, Worker};
//! use serde_json::{json, Value};
//!
//! struct Greet;
//!
//! #[leasehold::async_trait]
//! impl Kind for Greet {
//!     async fn run(&self, ctx: &Ctx) -> Result<Value, Error> {
//!         let name: String = ctx.step("name", || async { Ok("world".to_string()) }).await?;
//!         Ok(json!({"greeting": format!("hello, {name}")}))
//!     }
//! }
//!
//! #[tokio::main]
//! async fn main() -> anyhow::Result<()> {
//!     // Every flag and LH_* variable of `leasehold-worker` (see --help).
//!     Worker::from_env().kind("greet", Greet).run().await
//! }
//! ```
//!
//! The fleet's layout must list the kind: `leasehold setup --kinds greet`
//! (kinds can be added to a running fleet). Submit with `leasehold submit
//! greet --input '{}'`.
//!
//! What holds where (the guarantees):
//! - a recorded step never runs again for the job; a step whose attempt
//!   died before its record landed runs again (at least once, at most once
//!   recorded);
//! - a write tool's effect happens at most once ever, across attempts,
//!   workers and crashes (idempotency key, ledger, reconciliation, owner
//!   proof before the effect); an outcome nobody can know parks the job;
//! - a resumed attempt whose code asks for other steps than recorded parks
//!   the job (`journal_mismatch`) instead of running on guessed state.

mod agent;
mod builtin;
mod check;
mod ctx;
#[doc = include_str!("../../../docs/write-your-own-kind.md")]
pub mod guide {}
mod error;
mod journal;
mod records;
mod remote;
pub mod runtime;

/// Logs, traces and metrics as `leasehold-worker` sets them up, for a
/// worker binary that logs before it serves ([`Worker::serve`]).
///
/// ```no_run
/// # async fn f() -> anyhow::Result<()> {
/// let telemetry = leasehold::telemetry::init("my-worker");
/// tracing::info!(url = %leasehold::telemetry::redact_url("https://user:pw@host/"), "starting");
/// let r = leasehold::Worker::from_env().serve().await;
/// telemetry.shutdown();
/// r
/// # }
/// ```
pub mod telemetry {
    pub use leasehold_telemetry::observe::flush_before_abort;
    pub use leasehold_telemetry::spans;
    pub use leasehold_telemetry::trace::{init, Guard};
    pub use leasehold_telemetry::{env_help, redact_text, redact_url};
}

use std::sync::Arc;

use clap::{CommandFactory, FromArgMatches};
use leasehold_tools::{EffectsLedger, NoEvents, Toolbox};
use leasehold_worker::{End, Handler, JobCtx};
use tokio::sync::OnceCell;
use tokio_util::sync::CancellationToken;

pub use agent::{Agent, AgentOutput, ModelConfig};
pub use async_trait::async_trait;
pub use check::{JournalCheck, JournalVerdict};
pub use ctx::{Checkpoints, Child, Ctx, Signal, SpawnOptions, MAX_DEPTH, MAX_FAN_OUT};
pub use error::Error;
/// A boxed future, as [`Tool`] methods return.
pub use futures::future::BoxFuture;
pub use leasehold_core::machine::{SignalWait, Wait, WaitingFor};
pub use leasehold_core::JobRecord;
pub use leasehold_proto::{BudgetUsed, JobEvent, JobResult, Versions};
pub use leasehold_store::children::{ChildError, Outcome};
pub use leasehold_tools::{ExecCtx, Reconcile, Tool, ToolError, ToolKind, ToolSpec};
pub use leasehold_worker::metrics::{AttemptOutcome, Count};
pub use leasehold_worker::{Handle, Options};
pub use records::{ArtifactStore, EventLog, NewDocument, Report, StoredArtifact};
pub use remote::{hmac_sha256, signature, RemoteConfig, RemoteKind, PROTOCOL, SIGNATURE_HEADER};

/// Your code for one kind of job.
///
/// `run` is one attempt. It returns the job's output (kept as the record's
/// `result.output`, JSON) or an [`Error`] saying whether to retry, fail or
/// park. It must return promptly once [`Ctx::cancelled`] fires; steps and
/// tool calls do.
///
/// ```no_run
/// use leasehold::{Ctx, Error, Kind};
/// use serde_json::Value;
///
/// struct Echo;
///
/// #[leasehold::async_trait]
/// impl Kind for Echo {
///     fn version(&self) -> &str { "2" }
///     async fn run(&self, ctx: &Ctx) -> Result<Value, Error> {
///         Ok(ctx.input_json().clone())
///     }
/// }
/// ```
#[async_trait]
pub trait Kind: Send + Sync + 'static {
    /// The version of this kind's code, recorded with every step (and named
    /// in a journal mismatch). Bump it when steps change.
    fn version(&self) -> &str {
        "1"
    }

    /// One attempt of one job.
    async fn run(&self, ctx: &Ctx) -> Result<serde_json::Value, Error>;
}

/// The tools of a worker, one toolbox for all its kinds, opened on first use.
struct Tools {
    tools: Vec<Arc<dyn Tool>>,
    toolbox: OnceCell<Option<Arc<Toolbox>>>,
}

impl Tools {
    async fn toolbox(&self, job: &JobCtx) -> Result<Option<Arc<Toolbox>>, Error> {
        self.toolbox
            .get_or_try_init(|| async {
                if self.tools.is_empty() {
                    return Ok(None);
                }
                let ledger = EffectsLedger::open(&job.conn.js, &job.conn.layout.effects_bucket())
                    .await
                    .map_err(|e| Error::retryable(format!("effects ledger: {e}")))?;
                let mut tb =
                    Toolbox::new(Some(ledger), Arc::new(NoEvents)).observed(job.observer.clone());
                for t in &self.tools {
                    tb.register(t.clone())
                        .map_err(|e| Error::terminal(format!("tool: {e}")))?;
                }
                Ok(Some(Arc::new(tb)))
            })
            .await
            .cloned()
    }
}

/// The models a worker registered, by name, each with its one breaker.
#[derive(Default)]
pub(crate) struct Models(std::collections::BTreeMap<String, Arc<leasehold_model::Generator>>);

impl Models {
    pub(crate) fn get(&self, name: &str) -> Option<Arc<leasehold_model::Generator>> {
        self.0.get(name).cloned()
    }
    pub(crate) fn names(&self) -> Vec<&str> {
        self.0.keys().map(String::as_str).collect()
    }
}

/// Every kind of a worker, by name, as it runs them.
type Handlers = Vec<(String, Arc<KindHandler>)>;

/// A [`Kind`] as the worker runs it.
pub(crate) struct KindHandler {
    kind: Arc<dyn Kind>,
    tools: Arc<Tools>,
    models: Arc<Models>,
}

#[async_trait]
impl Handler for KindHandler {
    async fn run(&self, job: JobCtx) -> End {
        let tools = match self.tools.toolbox(&job).await {
            Ok(t) => t,
            Err(e) => return e.into_end(None, None),
        };
        let ctx = Ctx::new(
            job,
            self.kind.version().to_string(),
            tools,
            self.models.clone(),
        );
        let r = self.kind.run(&ctx).await;
        let (r, report) = ctx.finish(r).await;
        match r {
            Ok(v) => End::Completed(match report {
                Some(rep) => rep.into_result(v.to_string()),
                None => JobResult {
                    output: v.to_string(),
                    ..Default::default()
                },
            }),
            Err(e) => {
                let step = match &e {
                    Error::Park { reason, message } => ctx.parked_step(reason, message),
                    _ => None,
                };
                // A cancelled attempt keeps its report only when someone asked for the cancel.
                let report =
                    report.filter(|_| !matches!(e, Error::Cancelled) || ctx.cancel_requested());
                e.into_end(report, step)
            }
        }
    }
}

/// Your worker: its options, kinds and tools.
///
/// ```no_run
/// # struct Invoice;
/// # #[leasehold::async_trait]
/// # impl leasehold::Kind for Invoice {
/// #     async fn run(&self, _: &leasehold::Ctx) -> Result<serde_json::Value, leasehold::Error> { todo!() }
/// # }
/// # async fn f() -> anyhow::Result<()> {
/// let shutdown = tokio_util::sync::CancellationToken::new();
/// let handle = leasehold::Worker::from_env()
///     .kind("invoice", Invoice)
///     .start(shutdown.clone())
///     .await?;
/// // ... later: shutdown.cancel(); handle.wait().await?;
/// # Ok(()) }
/// ```
pub struct Worker {
    opts: Options,
    /// Whether `--kinds` was given; if not, the worker serves what it registers.
    kinds_given: bool,
    kinds: Vec<(String, Arc<dyn Kind>)>,
    tools: Vec<Arc<dyn Tool>>,
    models: Vec<(String, ModelConfig)>,
}

impl Worker {
    /// Options from the command line and the environment, exactly as
    /// `leasehold-worker` reads them (`--help` prints them and exits; a bad
    /// value exits with 2). Without `--kinds` (`LH_KINDS`) the worker serves
    /// the kinds it registers.
    ///
    /// ```no_run
    /// let w = leasehold::Worker::from_env();
    /// println!("concurrency {}", w.options().concurrency);
    /// ```
    pub fn from_env() -> Worker {
        Self::from_env_with_help("")
    }

    /// [`Worker::from_env`], with `help` printed after the options by
    /// `--help` (say which variables your kinds read).
    ///
    /// ```no_run
    /// let w = leasehold::Worker::from_env_with_help("Invoice variables:\n  INVOICE_ACCOUNTING_URL  the accounting API\n");
    /// ```
    pub fn from_env_with_help(help: &str) -> Worker {
        let mut cmd = Options::command();
        if !help.is_empty() {
            cmd = cmd.after_help(help.to_string());
        }
        let m = cmd.get_matches();
        let opts = Options::from_arg_matches(&m).unwrap_or_else(|e| e.exit());
        if let Err(e) = opts.validate() {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
        let kinds_given = m.value_source("kinds") != Some(clap::parser::ValueSource::DefaultValue);
        Worker {
            opts,
            kinds_given,
            kinds: Vec::new(),
            tools: Vec::new(),
            models: Vec::new(),
        }
    }

    /// A worker with these options (their `kinds` are the kinds served).
    ///
    /// ```no_run
    /// let opts = leasehold::Options::local("nats://127.0.0.1:4222", "lh");
    /// let w = leasehold::Worker::new(opts);
    /// ```
    pub fn new(opts: Options) -> Worker {
        Worker {
            opts,
            kinds_given: true,
            kinds: Vec::new(),
            tools: Vec::new(),
            models: Vec::new(),
        }
    }

    /// Serves `kind` under `name` (the `<kind>` of `lh.submit.<kind>`).
    ///
    /// ```no_run
    /// # struct Invoice;
    /// # #[leasehold::async_trait]
    /// # impl leasehold::Kind for Invoice {
    /// #     async fn run(&self, _: &leasehold::Ctx) -> Result<serde_json::Value, leasehold::Error> { todo!() }
    /// # }
    /// let w = leasehold::Worker::from_env().kind("invoice", Invoice);
    /// ```
    pub fn kind(mut self, name: &str, kind: impl Kind) -> Worker {
        self.kinds.push((name.to_string(), Arc::new(kind)));
        self
    }

    /// Registers a tool for [`Ctx::call`]. Its JSON Schema must compile
    /// (checked at the first job).
    ///
    /// ```no_run
    /// # fn f(my_tool: impl leasehold::Tool + 'static) {
    /// let w = leasehold::Worker::from_env().tool(my_tool);
    /// # }
    /// ```
    pub fn tool(mut self, tool: impl Tool + 'static) -> Worker {
        self.tools.push(Arc::new(tool));
        self
    }

    /// Registers a model for [`Ctx::agent`] under `name`. The library reads
    /// no variable for it: build the configuration yourself (or with
    /// `ModelConfig::from_env()`, which reads the `LH_MODEL_*` variables).
    ///
    /// ```no_run
    /// let cfg = leasehold::ModelConfig {
    ///     base_url: "https://api.openai.com/v1".into(),
    ///     model: "gpt-4o-mini".into(),
    ///     api_key: std::env::var("OPENAI_API_KEY").ok(),
    ///     ..Default::default()
    /// };
    /// let w = leasehold::Worker::from_env().model("main", cfg);
    /// ```
    pub fn model(mut self, name: &str, cfg: ModelConfig) -> Worker {
        self.models.push((name.to_string(), cfg));
        self
    }

    /// The options as they will be used.
    ///
    /// ```no_run
    /// let w = leasehold::Worker::from_env();
    /// assert!(w.options().concurrency > 0);
    /// ```
    pub fn options(&self) -> &Options {
        &self.opts
    }

    /// Connects, verifies the layout, opens the worker's session, and
    /// starts pulling; stops (draining, then handing jobs back) when
    /// `shutdown` fires.
    pub async fn start(self, shutdown: CancellationToken) -> anyhow::Result<Handle> {
        self.into_worker()?.start(shutdown).await
    }

    /// The worker service with this worker's kinds, tools and models.
    fn into_worker(self) -> anyhow::Result<leasehold_worker::Worker> {
        let (opts, kinds) = self.resolve()?;
        let mut w = leasehold_worker::Worker::new(opts);
        for (name, handler) in kinds {
            w = w.with_handler(&name, handler);
        }
        Ok(w)
    }

    /// The options and every kind as the worker runs them: the registered
    /// kinds, the remote ones (`--remote-kind`), the built-in ones, each
    /// with the tools and models.
    fn resolve(mut self) -> anyhow::Result<(Options, Handlers)> {
        // Kinds served by an HTTP service (--remote-kind NAME=URL), beside
        // the registered ones.
        let remote = RemoteConfig::from_options(&self.opts).map_err(|e| anyhow::anyhow!(e))?;
        // A remote kind's `generate` runs on the model `main`: the
        // LH_MODEL_* variables' unless the binary registered one.
        if !remote.is_empty()
            && !self.models.iter().any(|(n, _)| n == "main")
            && std::env::var_os("LH_MODEL_BASE_URL").is_some()
        {
            let cfg = ModelConfig::from_env().map_err(|e| anyhow::anyhow!("LH_MODEL_*: {e}"))?;
            self.models.push(("main".to_string(), cfg));
        }
        for (name, cfg) in remote {
            tracing::info!(kind = %name, url = %leasehold_telemetry::redact_url(&cfg.url), "remote kind");
            if self.kinds_given && !self.opts.kinds.contains(&name) {
                self.opts.kinds.push(name.clone());
            }
            self.kinds.retain(|(n, _)| *n != name);
            self.kinds.push((name, Arc::new(RemoteKind::new(cfg))));
        }
        if !self.kinds_given {
            self.opts.kinds = self.kinds.iter().map(|(n, _)| n.clone()).collect();
        }
        let tools = Arc::new(Tools {
            tools: self.tools,
            toolbox: OnceCell::new(),
        });
        let mut models = Models::default();
        for (name, cfg) in self.models {
            let g = agent::generator(cfg).map_err(|e| anyhow::anyhow!("model `{name}`: {e}"))?;
            models.0.insert(name, g);
        }
        let models = Arc::new(models);
        // The built-in kinds, unless a kind of the same name replaced one;
        // served when `--kinds` names them.
        for (name, kind) in builtin::kinds() {
            if !self.kinds.iter().any(|(n, _)| *n == name) {
                self.kinds.push((name, kind));
            }
        }
        let kinds = self
            .kinds
            .into_iter()
            .map(|(name, kind)| {
                let h = Arc::new(KindHandler {
                    kind,
                    tools: tools.clone(),
                    models: models.clone(),
                });
                (name, h)
            })
            .collect();
        Ok((self.opts, kinds))
    }

    /// Starts, and runs until SIGTERM or SIGINT (then drains: in-flight
    /// jobs get `--drain-timeout` to finish, then are handed back within
    /// `--hand-back-timeout`; the process exits within both + 1s whatever
    /// NATS does, with an error naming the jobs it could not hand back, and
    /// at once on a second signal). Logs go
    /// to stderr (`RUST_LOG`, `LH_LOG_FORMAT`); with `--http-listen`
    /// (`LH_HTTP_LISTEN`) it serves `/healthz`, `/readyz` and `/metrics` as
    /// `leasehold-worker` does, so the same probes and dashboards work.
    ///
    /// ```no_run
    /// # struct Invoice;
    /// # #[leasehold::async_trait]
    /// # impl leasehold::Kind for Invoice {
    /// #     async fn run(&self, _: &leasehold::Ctx) -> Result<serde_json::Value, leasehold::Error> { todo!() }
    /// # }
    /// # async fn f() -> anyhow::Result<()> {
    /// leasehold::Worker::from_env().kind("invoice", Invoice).run().await
    /// # }
    /// ```
    pub async fn run(self) -> anyhow::Result<()> {
        let telemetry = leasehold_telemetry::trace::init("leasehold-worker");
        let r = self.serve().await;
        telemetry.shutdown();
        r
    }

    /// [`Worker::run`] without setting up logs and traces: for a binary
    /// that did ([`telemetry::init`]) to log before it serves.
    ///
    /// ```no_run
    /// # async fn f() -> anyhow::Result<()> {
    /// let t = leasehold::telemetry::init("my-worker");
    /// let r = leasehold::Worker::from_env().serve().await;
    /// t.shutdown();
    /// r
    /// # }
    /// ```
    pub async fn serve(self) -> anyhow::Result<()> {
        if let Some(kind) = self.opts.journal_check.clone() {
            let checked = self.journal_check(&kind).await?;
            let mut bad = 0;
            for c in &checked {
                println!("{}", serde_json::to_string(c)?);
                bad += usize::from(!c.matches());
            }
            eprintln!(
                "journal check of `{kind}`: {} jobs with recorded steps, {} match this build, {bad} would not",
                checked.len(),
                checked.len() - bad
            );
            if bad > 0 {
                std::process::exit(1);
            }
            return Ok(());
        }
        let http = self.opts.http_listen;
        let w = self.into_worker()?;
        leasehold_worker::process::run(w, http).await
    }
}
