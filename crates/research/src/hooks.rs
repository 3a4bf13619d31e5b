//! The adapters between the section runner and the job's checkpoints: the
//! transcript journal, retry reports and tool events as `journal`, `retry`
//! and `tool` events (all through the flusher), and the crash points used
//! by tests. The tools offered to the model are `leasehold::runtime::AgentTools`.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use leasehold::runtime::{
    Message, ModelCall, RetryReport, RetryReporter, Thread, ToolEvent, ToolEvents, TranscriptHook,
};
use leasehold::Checkpoints as Flusher;
use serde_json::{json, Value};

use crate::state::JournalOp;

/// Journals one expert section's transcript as `journal` events.
pub struct Journal {
    pub flusher: Flusher,
    pub fp: String,
    pub expert: usize,
    pub index: usize,
    pub crash: Arc<Crash>,
}

impl Journal {
    fn entry(&self, op: JournalOp) -> u64 {
        self.flusher.event(
            "journal",
            json!({"v": self.fp, "expert": self.expert, "index": self.index, "entry": op}),
        )
    }
}

impl TranscriptHook for Journal {
    fn on_message(&self, generation: u32, message: &Message) {
        let n = self.entry(JournalOp::Message {
            generation,
            message: message.clone(),
        });
        match message {
            Message::Tool { .. } => self.crash.tool_result(&self.flusher, n),
            Message::Assistant { .. } => self.crash.model_response(&self.flusher, n),
            _ => {}
        }
    }

    fn on_thread(&self, thread: &Thread) {
        self.entry(JournalOp::Thread {
            generation: thread.generation,
            messages: thread.messages.clone(),
        });
    }

    /// The journal is durable before each model call: a kill -9 during the
    /// call then repeats that call only, never a recorded tool result's
    /// exchange. Costs one flush round trip per call (milliseconds, against
    /// a model call's seconds). A lost fence cancels the job elsewhere.
    fn before_generation(&self) -> Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(async move {
            let _ = self.flusher.barrier().await;
        })
    }

    fn on_model_call(&self, call: &ModelCall) {
        let tags = json!({"v": self.fp, "expert": self.expert, "index": self.index});
        self.flusher.event("model", call.tagged(tags));
    }
}

/// The model calls of a phase without a journal (outline, perspectives, a
/// final section) as `model` events; its messages are not journaled (a
/// kill repeats the phase's one call).
pub struct PhaseCalls {
    pub flusher: Flusher,
    pub tags: Value,
}

impl TranscriptHook for PhaseCalls {
    fn on_message(&self, _generation: u32, _message: &Message) {}

    fn on_model_call(&self, call: &ModelCall) {
        self.flusher.event("model", call.tagged(self.tags.clone()));
    }
}

/// Publishes retry reports as `retry` events, tagged with their section.
pub struct Reporter {
    pub flusher: Flusher,
    pub tags: Value,
}

impl RetryReporter for Reporter {
    fn report(&self, r: RetryReport) {
        let mut v = serde_json::to_value(&r).unwrap_or_default();
        if let (Some(obj), Some(tags)) = (v.as_object_mut(), self.tags.as_object()) {
            for (k, t) in tags {
                obj.insert(k.clone(), t.clone());
            }
        }
        self.flusher.event("retry", v);
    }
}

/// Publishes tool events as `tool` events.
pub struct ToolSink(pub Flusher);

impl ToolEvents for ToolSink {
    fn emit(&self, ev: ToolEvent) {
        self.0
            .event("tool", serde_json::to_value(&ev).unwrap_or_default());
    }
}

/// Where a test asks the worker to die (`LH_RESEARCH_CRASH_AT`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CrashPoint {
    /// After the phase's checkpoint is durable (`outline`, `perspectives`).
    AfterPhase(String),
    /// After the k-th expert section of this process is durable.
    AfterSection(u32),
    /// After the k-th journaled tool result of this process is durable.
    AfterToolResult(u32),
    /// After the k-th journaled model response of this process is durable.
    AfterModelResponse(u32),
    /// After the k-th final-document section is durable.
    MidFinal(u32),
    /// After the artifact is in the object store, before anything else.
    AfterArtifact,
    /// After the delivery, before the completion.
    AfterDelivery,
}

impl CrashPoint {
    pub fn parse(s: &str) -> Option<CrashPoint> {
        let (what, arg) = s.split_once(':').unwrap_or((s, ""));
        let k = || arg.parse::<u32>().ok().filter(|k| *k > 0);
        Some(match what {
            "after_phase" if !arg.is_empty() => CrashPoint::AfterPhase(arg.to_string()),
            "after_section" => CrashPoint::AfterSection(k()?),
            "after_tool_result" => CrashPoint::AfterToolResult(k()?),
            "after_model_response" => CrashPoint::AfterModelResponse(k()?),
            "mid_final" => CrashPoint::MidFinal(k()?),
            "after_artifact" => CrashPoint::AfterArtifact,
            "after_delivery" => CrashPoint::AfterDelivery,
            _ => return None,
        })
    }
}

/// The armed crash point of one run (armed only on a job's first owner
/// without stale reclaims, so the reclaiming worker proceeds).
#[derive(Debug, Default)]
pub struct Crash {
    point: Option<CrashPoint>,
    sections: AtomicU32,
    tool_results: AtomicU32,
    responses: AtomicU32,
    finals: AtomicU32,
}

impl Crash {
    pub fn new(point: Option<CrashPoint>, stale_reclaims: u32) -> Crash {
        Crash {
            point: point.filter(|_| stale_reclaims == 0),
            ..Crash::default()
        }
    }

    fn die(&self, what: &str) -> ! {
        tracing::error!(point = what, "LH_RESEARCH_CRASH_AT reached: aborting");
        leasehold::telemetry::flush_before_abort();
        std::process::abort();
    }

    /// After a durable phase checkpoint.
    pub async fn phase(&self, flusher: &Flusher, phase: &str) {
        if matches!(&self.point, Some(CrashPoint::AfterPhase(p)) if p == phase) {
            let _ = flusher.barrier().await;
            self.die(phase);
        }
    }

    pub async fn section(&self, flusher: &Flusher) {
        let k = self.sections.fetch_add(1, Ordering::SeqCst) + 1;
        if self.point == Some(CrashPoint::AfterSection(k)) {
            let _ = flusher.barrier().await;
            self.die("after_section");
        }
    }

    pub async fn final_section(&self, flusher: &Flusher) {
        let k = self.finals.fetch_add(1, Ordering::SeqCst) + 1;
        if self.point == Some(CrashPoint::MidFinal(k)) {
            let _ = flusher.barrier().await;
            self.die("mid_final");
        }
    }

    /// In the (sync) transcript hook: waits for the journal entry `n`.
    pub fn tool_result(&self, flusher: &Flusher, n: u64) {
        let k = self.tool_results.fetch_add(1, Ordering::SeqCst) + 1;
        if self.point == Some(CrashPoint::AfterToolResult(k)) {
            flusher.block_until_published(n, Duration::from_secs(10));
            self.die("after_tool_result");
        }
    }

    /// In the (sync) transcript hook: waits for the journal entry `n`.
    pub fn model_response(&self, flusher: &Flusher, n: u64) {
        let k = self.responses.fetch_add(1, Ordering::SeqCst) + 1;
        if self.point == Some(CrashPoint::AfterModelResponse(k)) {
            flusher.block_until_published(n, Duration::from_secs(10));
            self.die("after_model_response");
        }
    }

    pub fn at(&self, p: CrashPoint) {
        if self.point.as_ref() == Some(&p) {
            self.die(&format!("{p:?}"));
        }
    }
}
