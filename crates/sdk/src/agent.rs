//! [`Ctx::agent`]: a tool-calling conversation as one durable step, with the
//! runtime the research sections use: the transcript journal (a kill -9
//! repeats at most the model call in flight), generation retries, warm then
//! cold section retries, context sanitation and compaction, budgets, the
//! circuit breaker, the fallback model, retry reports, loop detection, and
//! structured output validated with one repair round.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex as StdMutex};

use leasehold_agent::{
    AgentTools, NoTools, SectionInput, SectionPolicy, SectionRunner, ToolExecutor, TranscriptHook,
};
use leasehold_model::{
    BreakerConfig, Budget, BudgetLimits, GenerationPolicy, Generator, ModelClient, RetryReport,
    RetryReporter, RunContext,
};
use leasehold_store::events::{Events, FenceError};
use leasehold_tools::{OwnerGuard, Toolbox};
use leasehold_transcript::{Message, Thread};
use leasehold_worker::JobCtx;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::sync::{mpsc, watch};

pub use leasehold_model::ModelConfig;

/// What one agent call is asked to do.
///
/// ```
/// let a = leasehold::Agent::new("gpt-4o-mini", "You book invoices.", "Book invoice F-17 of ACME.")
///     .tools(["lookup_supplier", "create_invoice"]);
/// assert_eq!(a.model, "gpt-4o-mini");
/// ```
#[derive(Debug, Clone)]
pub struct Agent {
    /// A model registered with [`crate::Worker::model`].
    pub model: String,
    /// The system prompt.
    pub system: String,
    /// The task: the conversation's first user message.
    pub prompt: String,
    /// Registered tools offered to the model (by name).
    pub tools: Vec<String>,
    /// A JSON Schema the final answer must follow (validated, one repair
    /// round; the provider's structured-output form is chosen for you).
    pub schema: Option<Value>,
    /// Model responses per attempt before it is stopped as a loop (16).
    pub max_rounds: u32,
    /// Warm retries of the conversation (2): the same thread, repaired.
    pub max_warm: u32,
    /// Cold retries (2): a new thread from the prompt.
    pub max_cold: u32,
    /// Limits of this call (steps, tokens, wall time, cost).
    pub limits: BudgetLimits,
}

impl Agent {
    /// A conversation with the registered model `model`, this system
    /// prompt and this task; no tools, no schema, default retries.
    ///
    /// ```
    /// let a = leasehold::Agent::new("main", "You summarize.", "Summarize this email: ...");
    /// assert!(a.tools.is_empty() && a.schema.is_none());
    /// ```
    pub fn new(model: &str, system: &str, prompt: &str) -> Agent {
        let d = SectionPolicy::default();
        Agent {
            model: model.into(),
            system: system.into(),
            prompt: prompt.into(),
            tools: Vec::new(),
            schema: None,
            max_rounds: d.max_rounds,
            max_warm: d.max_warm,
            max_cold: d.max_cold,
            limits: BudgetLimits::default(),
        }
    }

    /// Offers these registered tools.
    ///
    /// ```
    /// let a = leasehold::Agent::new("main", "s", "p").tools(["search"]);
    /// assert_eq!(a.tools, ["search"]);
    /// ```
    pub fn tools<I: IntoIterator<Item = S>, S: Into<String>>(mut self, names: I) -> Agent {
        self.tools = names.into_iter().map(Into::into).collect();
        self
    }

    /// The final answer must be JSON following `schema`.
    ///
    /// ```
    /// let a = leasehold::Agent::new("main", "s", "p")
    ///     .schema(serde_json::json!({"type": "object", "required": ["total"]}));
    /// assert!(a.schema.is_some());
    /// ```
    pub fn schema(mut self, schema: Value) -> Agent {
        self.schema = Some(schema);
        self
    }
}

/// How an agent call ended well.
///
/// ```no_run
/// # async fn f(ctx: &leasehold::Ctx) -> Result<(), leasehold::Error> {
/// let out = ctx.agent("summary", &leasehold::Agent::new("main", "s", "p")).await?;
/// tracing::info!(calls = out.model_calls, "{}", out.text);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentOutput {
    /// The final answer.
    pub text: String,
    /// The answer parsed, when a schema was asked for.
    pub json: Option<Value>,
    /// Model calls this attempt made (0 when the answer was recorded).
    pub model_calls: u32,
    /// Tool calls this attempt made.
    pub tool_calls: u32,
}

/// A model of the worker: its client and the one breaker its calls share.
pub(crate) fn generator(cfg: ModelConfig) -> Result<Arc<Generator>, String> {
    let client = ModelClient::new(cfg).map_err(|e| e.to_string())?;
    Ok(Arc::new(Generator::new(
        client,
        GenerationPolicy::default(),
        BreakerConfig::default(),
    )))
}

/// The conversation's events (journal entries, tool events, retry reports),
/// published in order through the job's fence by one task; a model call
/// waits until everything before it is durable.
struct Emitter {
    tx: mpsc::UnboundedSender<(&'static str, Value)>,
    queued: StdMutex<u64>,
    written: watch::Receiver<u64>,
    /// Why the conversation's events stopped being written (a newer owner,
    /// the stream full), once they did: what the attempt did after that is
    /// not durable, so the step must not be recorded as if it were.
    broken: Arc<StdMutex<Option<FenceError>>>,
}

/// The longest wait between tries of an event NATS did not answer.
const EMIT_RETRY_CAP: std::time::Duration = std::time::Duration::from_secs(2);

impl Emitter {
    fn start(job: JobCtx, step: &str) -> Arc<Emitter> {
        let (tx, mut rx) = mpsc::unbounded_channel::<(&'static str, Value)>();
        let (done_tx, written) = watch::channel(0u64);
        let broken = Arc::new(StdMutex::new(None));
        let failed = broken.clone();
        let r = &job.record;
        // Message ids unique to this attempt's conversation: a retried
        // event that had landed is answered as a duplicate.
        let prefix = format!("{}:{}:{}:{step}", r.id, r.created_at, r.epoch);
        tokio::spawn(async move {
            let mut n = 0u64;
            while let Some((ty, data)) = rx.recv().await {
                let msg_id = format!("{prefix}:{n}");
                let mut wait = leasehold_core::retry::Backoff::new(
                    std::time::Duration::from_millis(100),
                    EMIT_RETRY_CAP,
                );
                loop {
                    match crate::ctx::emit_once(&job, ty, data.clone(), &msg_id).await {
                        Ok(_) => break,
                        // NATS did not answer (a lost PubAck, a leader
                        // election): the same event again, same id.
                        Err(FenceError::Nats(why)) => {
                            tracing::warn!(job = %job.record.id, error = %why, "an agent event was not answered; trying again");
                            tokio::select! {
                                _ = tokio::time::sleep(wait.pause()) => {}
                                _ = job.cancel.cancelled() => return,
                            }
                        }
                        // A newer owner (the attempt stops through its
                        // cancel token) or a full stream: nothing more is
                        // written, and the step says so.
                        Err(e) => {
                            if let Ok(mut g) = failed.lock() {
                                *g = Some(e);
                            }
                            return;
                        }
                    }
                }
                n += 1;
                let _ = done_tx.send(n);
            }
        });
        Arc::new(Emitter {
            tx,
            queued: StdMutex::new(0),
            written,
            broken,
        })
    }

    /// The error that stopped the writer, as the step's outcome.
    fn broken(&self) -> Option<crate::Error> {
        let g = self.broken.lock().ok()?;
        g.as_ref().map(|e| match e {
            FenceError::Lost { .. } => crate::Error::stopped(format!("the agent's journal: {e}")),
            e => crate::Error::retryable(format!(
                "the agent's journal could not be written ({e}); the step is retried from what was journaled"
            )),
        })
    }

    fn push(&self, ty: &'static str, data: Value) {
        *self.queued.lock().expect("emitter") += 1;
        let _ = self.tx.send((ty, data));
    }

    /// Returns once everything pushed so far is written (or never will be).
    async fn flushed(&self) {
        let want = *self.queued.lock().expect("emitter");
        let mut w = self.written.clone();
        let _ = w.wait_for(|n| *n >= want).await;
    }
}

/// Journals the conversation as `agent` events of its step.
struct Journal {
    out: Arc<Emitter>,
    step: String,
}

impl TranscriptHook for Journal {
    fn on_message(&self, generation: u32, message: &Message) {
        self.out.push(
            "agent",
            json!({"step": self.step, "entry": {"message": {"generation": generation, "message": message}}}),
        );
    }
    fn on_thread(&self, thread: &Thread) {
        self.out.push(
            "agent",
            json!({"step": self.step, "entry": {"thread": {"generation": thread.generation, "messages": thread.messages}}}),
        );
    }
    fn before_generation(&self) -> Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(self.out.flushed())
    }
    fn on_model_call(&self, call: &leasehold_agent::ModelCall) {
        self.out
            .push("model", call.tagged(json!({"step": self.step})));
    }
}

/// The conversations journaled so far, by step, as one attempt has read
/// them: each `agent` call reads only the events after the last one it
/// read (a job of n agent steps reads its journal once, not n times).
#[derive(Default)]
pub(crate) struct Threads(tokio::sync::Mutex<ThreadsRead>);

#[derive(Default)]
struct ThreadsRead {
    /// The stream sequence of the last `agent` event folded in.
    through: u64,
    /// How many events were read in all (each once).
    read: u64,
    by_step: HashMap<String, Thread>,
}

impl Threads {
    /// The thread an earlier attempt (or an earlier try of this step)
    /// journaled for `step` of job `job_id`, if any.
    async fn of(
        &self,
        conn: &leasehold_store::Conn,
        job_id: &str,
        step: &str,
    ) -> Result<Option<Thread>, String> {
        let mut read = self.0.lock().await;
        let events = Events::new(conn)
            .read_type_from(job_id, "agent", read.through + 1)
            .await
            .map_err(|e| format!("reading the agent's journal: {e}"))?;
        for (seq, ev) in events {
            read.through = read.through.max(seq);
            read.read += 1;
            fold(&mut read.by_step, &ev.data_map());
        }
        Ok(read.by_step.get(step).cloned())
    }
}

/// Folds one `agent` event into the threads by step: a `thread` entry
/// starts (or restarts) its step's thread, a `message` entry extends it
/// when it belongs to the thread's generation.
fn fold(by_step: &mut HashMap<String, Thread>, d: &serde_json::Map<String, Value>) {
    let Some(step) = d.get("step").and_then(Value::as_str) else {
        return;
    };
    let entry = d.get("entry").cloned().unwrap_or(Value::Null);
    if let Some(t) = entry.get("thread") {
        if let Ok(messages) = serde_json::from_value::<Vec<Message>>(t["messages"].clone()) {
            by_step.insert(
                step.to_string(),
                Thread {
                    generation: t["generation"].as_u64().unwrap_or(0) as u32,
                    messages,
                },
            );
        }
    } else if let Some(m) = entry.get("message") {
        let generation = m["generation"].as_u64().unwrap_or(0) as u32;
        if let (Some(t), Ok(msg)) = (
            by_step.get_mut(step),
            serde_json::from_value::<Message>(m["message"].clone()),
        ) {
            if t.generation == generation {
                t.messages.push(msg);
            }
        }
    }
}

/// Tool events of the conversation as `tool` events, in order.
struct ToolSink(Arc<Emitter>);

impl leasehold_tools::ToolEvents for ToolSink {
    fn emit(&self, ev: leasehold_tools::ToolEvent) {
        self.0
            .push("tool", serde_json::to_value(&ev).unwrap_or_default());
    }
}

/// Retry reports as `retry` events of the step.
struct Reports {
    out: Arc<Emitter>,
    step: String,
}

impl RetryReporter for Reports {
    fn report(&self, r: RetryReport) {
        let mut v = serde_json::to_value(&r).unwrap_or_default();
        v["step"] = json!(self.step);
        self.out.push("retry", v);
    }
}

/// Runs one agent call for step `step` (see [`crate::Ctx::agent`]).
pub(crate) async fn run(
    job: &JobCtx,
    threads: &Threads,
    step: &str,
    generator: Arc<Generator>,
    toolbox: Option<Arc<Toolbox>>,
    spec: &Agent,
) -> Result<AgentOutput, crate::Error> {
    use crate::Error;
    let initial = threads
        .of(&job.conn, &job.record.id, step)
        .await
        .map_err(Error::retryable)?;
    let response_format = spec
        .schema
        .as_ref()
        .map(|s| json!({"type": "json_schema", "json_schema": {"name": "answer", "schema": s}}));
    let out = Emitter::start(job.clone(), step);
    let tools: Arc<dyn ToolExecutor> = match toolbox {
        Some(toolbox) => Arc::new(AgentTools {
            toolbox,
            job_id: job.record.id.clone(),
            incarnation: job.record.created_at.clone(),
            epoch: job.record.epoch,
            conversation: step.to_string(),
            offered: spec.tools.clone(),
            guard: OwnerGuard::shared(job.gate.clone()),
            events: Arc::new(ToolSink(out.clone())),
        }),
        None => Arc::new(NoTools),
    };
    let runner = SectionRunner {
        generator,
        tools,
        hook: Arc::new(Journal {
            out: out.clone(),
            step: step.to_string(),
        }),
        policy: SectionPolicy {
            max_warm: spec.max_warm,
            max_cold: spec.max_cold,
            max_rounds: spec.max_rounds,
            response_format,
            ..SectionPolicy::default()
        },
    };
    let mut ctx = RunContext::new(Budget::new(spec.limits.clone(), Default::default()));
    ctx.cancel = job.cancel.clone();
    ctx.flow = job.flow.clone();
    ctx.reporter = Arc::new(Reports {
        out: out.clone(),
        step: step.to_string(),
    });
    let r = runner
        .run(
            SectionInput {
                system: spec.system.clone(),
                section_prompt: spec.prompt.clone(),
                rolling_context: String::new(),
                initial,
            },
            &ctx,
        )
        .await;
    // The step's record comes after its journal, tool events and reports.
    out.flushed().await;
    if let Some(e) = out.broken() {
        return Err(e);
    }
    let text = Error::of_section(r.outcome, &format!("agent `{step}`"))?;
    let json = match &spec.schema {
        Some(_) => Some(
            serde_json::from_str::<Value>(text.trim())
                .map_err(|e| Error::retryable(format!("the agent's answer is not JSON: {e}")))?,
        ),
        None => None,
    };
    Ok(AgentOutput {
        text,
        json,
        model_calls: r.model_calls,
        tool_calls: r.tool_calls,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use leasehold_store::events::event;

    fn entry(step: &str, entry: Value) -> leasehold_proto::JobEvent {
        event(
            "j",
            1,
            "agent",
            Some("w"),
            json!({"step": step, "entry": entry}),
        )
    }

    fn message(text: &str) -> Message {
        Message::assistant(text)
    }

    /// Review G18: every agent step read the job's whole journal, O(n²)
    /// in its steps. Now each event is read once per attempt, and each
    /// step still gets its own thread (the latest generation's, with the
    /// messages after it), against a real nats-server.
    #[tokio::test]
    async fn each_agent_step_reads_only_the_journal_after_the_last_read() {
        let server = leasehold_harness::NatsServer::start();
        leasehold_harness::wait_for_jetstream(&server.url(), std::time::Duration::from_secs(10))
            .await;
        let conn = leasehold_store::NatsArgs::local(server.url(), "lh")
            .connect("test")
            .await
            .unwrap();
        leasehold_store::setup::ensure(&conn, &Default::default())
            .await
            .unwrap();
        let events = Events::new(&conn);
        const STEPS: usize = 40;
        for i in 0..STEPS {
            let step = format!("agent:s{i}");
            let first = json!({"thread": {"generation": 0, "messages": [message("old")]}});
            let again =
                json!({"thread": {"generation": 1, "messages": [message(&format!("t{i}"))]}});
            let more = json!({"message": {"generation": 1, "message": message(&format!("m{i}"))}});
            let stale = json!({"message": {"generation": 0, "message": message("stale")}});
            for e in [first, again, more, stale] {
                events.publish(&entry(&step, e), None).await.unwrap();
            }
        }
        let threads = Threads::default();
        for i in 0..STEPS {
            let t = threads
                .of(&conn, "j", &format!("agent:s{i}"))
                .await
                .unwrap()
                .expect("journaled");
            assert_eq!(t.generation, 1);
            assert_eq!(
                t.messages,
                vec![message(&format!("t{i}")), message(&format!("m{i}"))]
            );
        }
        assert!(threads
            .of(&conn, "j", "agent:none")
            .await
            .unwrap()
            .is_none());
        // One step journaled after the reads: the next read folds it in.
        let late = json!({"thread": {"generation": 3, "messages": [message("late")]}});
        events
            .publish(&entry("agent:s0", late), None)
            .await
            .unwrap();
        let t = threads.of(&conn, "j", "agent:s0").await.unwrap().unwrap();
        assert_eq!(t.generation, 3);
        let read = threads.0.lock().await.read;
        assert_eq!(
            read,
            (STEPS * 4 + 1) as u64,
            "each event read once, not once per step"
        );
    }
}
