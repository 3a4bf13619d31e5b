//! The observer facade: how library crates (model, tools, research) report
//! what the metrics count without knowing about Prometheus.
//!
//! A worker hands its [`crate::metrics::Metrics`] as an [`Observer`] to what
//! reports on its behalf: its flow control (and through it each run's model
//! requests: `RunContext::flow`), the toolboxes of its jobs, their
//! checkpoint flushers. No process global: two workers in one process count
//! apart. Made outside a worker, each reports to [`none`]. Every method has
//! an empty default, so an observer implements only what it needs and new
//! events do not break implementors.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// One model request (one HTTP exchange, not a whole generation with its
/// retries).
#[derive(Debug, Clone, Copy)]
pub struct ModelRequest<'a> {
    /// The model the request named (the fallback model when it was used).
    pub model: &'a str,
    /// `ok`, or the failure class (`rate_limited`, `read_timeout`, ...:
    /// `FailureClass::as_str`).
    pub outcome: &'a str,
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// From sending the request to the end of the response.
    pub elapsed: Duration,
}

/// How a tool call ended, from the caller's point of view.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ToolOutcome {
    /// A result came back (executed now, replayed or reconciled).
    Ok,
    /// The tool ran and failed.
    Error,
    /// Not run: invalid arguments, refused destination, key reuse.
    Refused,
}

impl ToolOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            ToolOutcome::Ok => "ok",
            ToolOutcome::Error => "error",
            ToolOutcome::Refused => "refused",
        }
    }
}

/// What happened to a side effect (a write tool's call) in the ledger.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EffectOutcome {
    /// Run now, under a fresh `in_flight` key.
    Executed,
    /// A `done` key: the stored result was returned.
    Replayed,
    /// An `in_flight` key resolved by asking the destination.
    Reconciled,
    /// Outcome uncertain and not reconcilable: the job is parked.
    Parked,
}

impl EffectOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            EffectOutcome::Executed => "executed",
            EffectOutcome::Replayed => "replayed",
            EffectOutcome::Reconciled => "reconciled",
            EffectOutcome::Parked => "parked",
        }
    }
}

/// Receives what library code reports. Implementations must be cheap and
/// must not block (they run on the reporting task).
pub trait Observer: Send + Sync {
    fn model_request(&self, _r: &ModelRequest<'_>) {}
    /// A generation retry was decided (eligible or not), by failure class.
    fn model_retry(&self, _class: &str) {}
    fn tool_call(&self, _tool: &str, _outcome: ToolOutcome) {}
    fn effect(&self, _tool: &str, _outcome: EffectOutcome) {}
    /// One flusher batch made durable (events published, progress written).
    fn checkpoint_flush(&self, _elapsed: Duration, _events: usize) {}
    /// A model request's admission by flow control: `admitted`, `waited`
    /// (admitted after waiting) or `refused` (gave up waiting).
    fn flow_admission(&self, _model: &str, _outcome: &str) {}
    /// A provider key was paused (`cooldown` or `breaker`), here or by the fleet.
    fn flow_pause(&self, _model: &str, _kind: &str) {}
    /// A provider key's limit and this process's slice of it
    /// (`limit` = `rpm`, `tpm` or `concurrency`; per minute for the rates).
    fn flow_limit(&self, _model: &str, _limit: &str, _fleet: f64, _slice: f64) {}
    /// A job of `tenant` started (`+1`) or ended (`-1`) an attempt here.
    fn tenant_running(&self, _tenant: &str, _delta: i64) {}
    /// Tickets of `tenant` in `kind`'s lanes (waiting or running), as this
    /// worker last counted them.
    fn tenant_tickets(&self, _kind: &str, _tenant: &str, _n: u64) {}
}

/// Drops everything (the default before [`install`]).
#[derive(Debug, Default)]
pub struct NoObserver;

impl Observer for NoObserver {}

/// An observer that drops everything, as an `Arc` (what a flow control,
/// a toolbox or a flusher made outside a worker reports to).
pub fn none() -> Arc<dyn Observer> {
    Arc::new(NoObserver)
}

type Flush = Box<dyn Fn() + Send + Sync>;

static FLUSH: OnceLock<Flush> = OnceLock::new();

/// Sets how [`flush_before_abort`] exports what is buffered (the trace
/// exporter registers itself here when it starts). First call wins.
pub fn set_flush(f: Flush) {
    let _ = FLUSH.set(f);
}

/// Exports buffered telemetry now, for a process about to abort (a test
/// crash point): the spans closed so far reach the collector, so a trace
/// shows where its attempt died. Does nothing when nothing is exported.
pub fn flush_before_abort() {
    if let Some(f) = FLUSH.get() {
        f();
    }
}
