//! The section runner: one section's tool loop with generation, warm and
//! cold retries.
//!
//! A section gets one initial attempt, up to `max_warm` warm retries (the
//! same thread, repaired by [`leasehold_transcript::sanitize`], compacted
//! after a context-window failure) and up to `max_cold` cold retries (a new
//! thread generation from the section prompt and the rolling context), then
//! it is skipped with its reason and reports. Tools run only after a complete
//! response; a partial proposal never executes. Refusals, content filters,
//! loops and uncertain external effects park the section for a person;
//! terminal errors fail it; cancellation and exhausted budgets stop it.
//!
//! [`RetryMode::NaiveWholeTurn`] restarts the whole turn from the prompt on
//! every failure. It exists only so a test can show the repeated tool calls
//! that the warm retry avoids.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use leasehold_transcript::{compact, sanitize, CompactionPolicy, Message, Thread, Verdict};
use serde::{Deserialize, Serialize};

use leasehold_model::{
    Action, BudgetKind, ChatRequest, FailureClass, Generator, ModelError, RetryReport, RetryScope,
    RunContext,
};

/// What a tool call came to.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind", content = "text")]
pub enum ToolOutcome {
    /// The result, given to the model.
    Ok(String),
    /// An error the model should see and can act on (invalid arguments, a
    /// 404): returned as the tool result.
    Error(String),
    /// The call failed transiently; the section attempt fails and a warm
    /// retry continues after the last complete exchange.
    Failed(String),
    /// A side effect whose outcome is unknown: park for review.
    Uncertain(String),
}

/// Runs tools for the agent. Implemented by the tools crate.
pub trait ToolExecutor: Send + Sync {
    /// Tool definitions offered to the model (`{"type":"function",...}`).
    fn specs(&self) -> Vec<serde_json::Value>;
    /// Runs one call. `call_id` is stable across retries of the same
    /// proposal, which makes it usable in an idempotency key.
    fn call<'a>(
        &'a self,
        name: &'a str,
        args: &'a serde_json::Value,
        call_id: &'a str,
    ) -> Pin<Box<dyn Future<Output = ToolOutcome> + Send + 'a>>;
}

/// Called after each completed model response and each tool result, and
/// whenever the thread is replaced (warm repair, cold rebuild), so the
/// workflow can journal the transcript.
pub trait TranscriptHook: Send + Sync {
    fn on_message(&self, generation: u32, message: &Message);
    fn on_thread(&self, _thread: &Thread) {}
    /// Awaited before each model call. A journaling hook returns once what it
    /// recorded is durable, so a crash during the call repeats only that call.
    fn before_generation(&self) -> Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(async {})
    }
    /// Called once per model call of the section (one generation, its
    /// retries of the same request included), when it ended: a workflow
    /// records it as a `model` event.
    fn on_model_call(&self, _call: &ModelCall) {}
}

/// One model call as the section runner saw it: what the provider
/// reported it used and how long the call took, retries included.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelCall {
    /// The model that answered (the provider's name for it), or the one
    /// asked when the call failed.
    pub model: String,
    /// Prompt tokens, as the provider reported them (or estimated).
    pub tokens_in: u64,
    /// Completion tokens.
    pub tokens_out: u64,
    /// Whether the provider reported no usage and the counts are estimates.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub estimated: bool,
    /// From the request to the last token (or the failure), in ms.
    pub duration_ms: u64,
    /// Time to the first token, in ms, when one came.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_token_ms: Option<u64>,
    /// HTTP attempts made (generation retries included).
    pub attempts: u32,
    /// `ok`, `tool_calls` (the model asked for tools) or the failure class.
    pub outcome: String,
    /// Tool calls the model asked for.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub tool_calls: usize,
    /// The thread generation the call belonged to.
    pub generation: u32,
    /// The fallback model used, if the primary was not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback: Option<String>,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

impl ModelCall {
    /// The call as an event's data, with `tags` (the section or step it
    /// belongs to) merged in.
    pub fn tagged(&self, tags: serde_json::Value) -> serde_json::Value {
        let mut v = serde_json::to_value(self).unwrap_or_default();
        if let (Some(o), serde_json::Value::Object(t)) = (v.as_object_mut(), tags) {
            o.extend(t);
        }
        v
    }
}

/// A hook that does nothing.
pub struct NoHook;

impl TranscriptHook for NoHook {
    fn on_message(&self, _generation: u32, _message: &Message) {}
}

/// Offers no tools: a conversation that must answer from its prompt
/// (research's outline, perspectives and final synthesis; an SDK agent of a
/// worker with no tools). A call anyway is returned to the model as an error.
pub struct NoTools;

impl ToolExecutor for NoTools {
    fn specs(&self) -> Vec<serde_json::Value> {
        Vec::new()
    }

    fn call<'a>(
        &'a self,
        name: &'a str,
        _args: &'a serde_json::Value,
        _call_id: &'a str,
    ) -> Pin<Box<dyn Future<Output = ToolOutcome> + Send + 'a>> {
        Box::pin(async move { ToolOutcome::Error(format!("no tools here (asked for `{name}`)")) })
    }
}

/// How section-level retries work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RetryMode {
    WarmThenCold,
    /// Test-only comparison: every retry restarts the whole turn.
    NaiveWholeTurn,
}

impl RetryMode {
    /// What a cold retry keeps, as its report says.
    fn cold_retains(self) -> &'static str {
        match self {
            RetryMode::WarmThenCold => {
                "section prompt and rolling context only (new thread generation)"
            }
            RetryMode::NaiveWholeTurn => "nothing: whole turn restarted from the prompt",
        }
    }
}

/// Section policy.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SectionPolicy {
    pub max_warm: u32,
    pub max_cold: u32,
    pub mode: RetryMode,
    pub compaction: CompactionPolicy,
    /// Structured output wanted for the final answer, if any.
    pub response_format: Option<serde_json::Value>,
    /// Model responses per attempt before the attempt is stopped as a loop.
    pub max_rounds: u32,
}

impl Default for SectionPolicy {
    fn default() -> Self {
        SectionPolicy {
            max_warm: 2,
            max_cold: 2,
            mode: RetryMode::WarmThenCold,
            compaction: CompactionPolicy::default(),
            response_format: None,
            max_rounds: 16,
        }
    }
}

/// What a section is asked to do.
#[derive(Debug, Clone, Default)]
pub struct SectionInput {
    pub system: String,
    pub section_prompt: String,
    /// Summary of completed work, used for every (cold) thread generation.
    pub rolling_context: String,
    /// A thread to resume (from a journal). It is sanitized first; if no
    /// warm continuation is sound, a cold generation starts instead.
    pub initial: Option<Thread>,
}

/// How a section ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "outcome")]
pub enum SectionOutcome {
    Completed {
        text: String,
    },
    /// Retries exhausted (or refused): recorded as skipped, the job goes on.
    Skipped {
        reason: String,
    },
    /// Needs a person: refusal, content filter, loop, uncertain effect.
    Parked {
        class: FailureClass,
        reason: String,
    },
    /// Terminal: retrying cannot help (auth, bad request, exhausted quota).
    Failed {
        class: FailureClass,
        reason: String,
    },
    BudgetExhausted {
        kind: BudgetKind,
    },
    Cancelled,
}

/// The result of a section run.
#[derive(Debug, Clone)]
pub struct SectionResult {
    pub outcome: SectionOutcome,
    pub reports: Vec<RetryReport>,
    /// The final thread (the journal's view of it).
    pub thread: Thread,
    pub model_calls: u32,
    pub tool_calls: u32,
    pub fallback_used: Option<String>,
}

/// Runs sections.
#[derive(Clone)]
pub struct SectionRunner {
    pub generator: Arc<Generator>,
    pub tools: Arc<dyn ToolExecutor>,
    pub hook: Arc<dyn TranscriptHook>,
    pub policy: SectionPolicy,
}

/// Mutable state of one section run.
struct Run {
    thread: Thread,
    reports: Vec<RetryReport>,
    model_calls: u32,
    tool_calls: u32,
    fallback_used: Option<String>,
    /// (tool, canonical args) → times called in this thread generation.
    seen_calls: HashMap<(String, String), u32>,
}

/// The outcome `err` ends the section with, or `None` when the section
/// tries again.
fn ending(err: &ModelError, class: FailureClass, reason: &str) -> Option<SectionOutcome> {
    let reason = reason.to_string();
    Some(match class.action() {
        Action::Terminal => SectionOutcome::Failed { class, reason },
        Action::Park => SectionOutcome::Parked { class, reason },
        Action::Stop => match err {
            ModelError::RetryRefused { .. } => SectionOutcome::Skipped { reason },
            ModelError::Budget(kind) => SectionOutcome::BudgetExhausted { kind: *kind },
            ModelError::Deadline => SectionOutcome::BudgetExhausted {
                kind: BudgetKind::WallTime,
            },
            _ => SectionOutcome::Cancelled,
        },
        Action::Retry | Action::RepairContext | Action::ReAsk | Action::ReturnToModel => {
            return None
        }
    })
}

impl SectionRunner {
    pub fn new(generator: Arc<Generator>, tools: Arc<dyn ToolExecutor>) -> Self {
        SectionRunner {
            generator,
            tools,
            hook: Arc::new(NoHook),
            policy: SectionPolicy::default(),
        }
    }

    /// Runs the section to one of its outcomes. Never loops forever: every
    /// path consumes an attempt or a budget.
    pub async fn run(&self, input: SectionInput, ctx: &RunContext) -> SectionResult {
        let fresh = |generation: u32| Thread {
            generation,
            messages: leasehold_transcript::build_messages(
                &input.system,
                &input.rolling_context,
                &input.section_prompt,
            ),
        };
        let mut run = Run {
            thread: fresh(0),
            reports: Vec::new(),
            model_calls: 0,
            tool_calls: 0,
            fallback_used: None,
            seen_calls: HashMap::new(),
        };
        if let Some(initial) = input.initial.clone() {
            let repair = sanitize(&initial.messages, &input.section_prompt);
            run.thread = match repair.report.verdict {
                Verdict::Warm => Thread {
                    generation: initial.generation,
                    messages: repair.messages,
                },
                Verdict::ColdOnly => fresh(initial.generation + 1),
            };
        }
        self.hook.on_thread(&run.thread);
        let (mut warm_used, mut cold_used) = (0u32, 0u32);
        loop {
            let err = match self.attempt(&mut run, ctx).await {
                Ok(text) => return finish(run, SectionOutcome::Completed { text }),
                Err(e) => e,
            };
            let class = err.class();
            let reason = format!("{class}: {err}");
            if let Some(outcome) = ending(&err, class, &reason) {
                return finish(run, outcome);
            }
            if let ModelError::CircuitOpen { .. } = err {
                // Fast failure: the breaker's cool-down is the wait.
                if let Err(stop) = ctx.wait(err.retry_after().unwrap_or_default()).await {
                    let outcome = match stop {
                        ModelError::Cancelled => SectionOutcome::Cancelled,
                        _ => SectionOutcome::BudgetExhausted {
                            kind: BudgetKind::WallTime,
                        },
                    };
                    return finish(run, outcome);
                }
            }
            let budget_left = ctx.budget_left();
            let attempt = 2 + warm_used + cold_used;
            // Warm first, unless the mode is the naive comparison.
            if self.policy.mode == RetryMode::WarmThenCold && warm_used < self.policy.max_warm {
                match self.warm_repair(&run.thread, &input.section_prompt, class) {
                    Ok((messages, retained)) => {
                        warm_used += 1;
                        run.thread.messages = messages;
                        self.hook.on_thread(&run.thread);
                        ctx.emit(
                            RetryReport::scoped(
                                RetryScope::Warm,
                                (reason.clone(), true, retained),
                                attempt,
                                budget_left,
                                class,
                            ),
                            &mut run.reports,
                        );
                        continue;
                    }
                    Err(why) => {
                        warm_used = self.policy.max_warm;
                        ctx.emit(
                            RetryReport::scoped(
                                RetryScope::Warm,
                                (
                                    format!("{reason}; warm refused: {why}"),
                                    false,
                                    "nothing".into(),
                                ),
                                attempt,
                                budget_left,
                                class,
                            ),
                            &mut run.reports,
                        );
                    }
                }
            }
            let max_cold = match self.policy.mode {
                RetryMode::WarmThenCold => self.policy.max_cold,
                RetryMode::NaiveWholeTurn => self.policy.max_warm + self.policy.max_cold,
            };
            if cold_used < max_cold {
                cold_used += 1;
                run.thread = match self.policy.mode {
                    RetryMode::WarmThenCold => run.thread.cold_rebuild(
                        &input.system,
                        &input.rolling_context,
                        &input.section_prompt,
                    ),
                    RetryMode::NaiveWholeTurn => fresh(run.thread.generation),
                };
                run.seen_calls.clear();
                self.hook.on_thread(&run.thread);
                let retained = self.policy.mode.cold_retains().to_string();
                ctx.emit(
                    RetryReport::scoped(
                        RetryScope::Cold,
                        (reason, true, retained),
                        attempt,
                        ctx.budget_left(),
                        class,
                    ),
                    &mut run.reports,
                );
                continue;
            }
            let why =
                format!("{reason}; section retries exhausted ({warm_used} warm, {cold_used} cold)");
            let r = (why, false, "nothing".to_string());
            let report =
                RetryReport::scoped(RetryScope::Cold, r, attempt, ctx.budget_left(), class);
            ctx.emit(report, &mut run.reports);
            return finish(
                run,
                SectionOutcome::Skipped {
                    reason: format!("after {} attempts: {reason}", attempt - 1),
                },
            );
        }
    }

    /// Repairs the thread for a warm retry: the sound prefix, compacted when
    /// the failure was the context window. `Err` says why only cold can go on.
    fn warm_repair(
        &self,
        thread: &Thread,
        prompt: &str,
        class: FailureClass,
    ) -> Result<(Vec<Message>, String), String> {
        let repair = sanitize(&thread.messages, prompt);
        if repair.report.verdict != Verdict::Warm {
            return Err(repair
                .report
                .cold_reason
                .unwrap_or_else(|| "transcript unsound".into()));
        }
        let mut messages = repair.messages;
        let mut note = String::new();
        if class == FailureClass::ContextExceeded {
            let (compacted, rep) =
                compact(&messages, &self.policy.compaction).map_err(|e| e.to_string())?;
            note = format!(
                ", compacted {} -> {} chars",
                rep.before_chars, rep.after_chars
            );
            messages = compacted;
        }
        Ok((
            messages,
            format!(
                "{} messages kept, {} complete tool-call groups reused, {} dropped{note}",
                repair.report.kept, repair.report.tool_groups_kept, repair.report.dropped
            ),
        ))
    }

    /// One attempt: the tool loop until a final answer or an error.
    async fn attempt(&self, run: &mut Run, ctx: &RunContext) -> Result<String, ModelError> {
        let mut reasked = false;
        for _ in 0..self.policy.max_rounds {
            ctx.budget
                .lock()
                .expect("budget lock")
                .take_step()
                .map_err(ModelError::Budget)?;
            let req = ChatRequest {
                messages: run.thread.messages.clone(),
                tools: self.tools.specs(),
                response_format: self.policy.response_format.clone(),
                ..Default::default()
            };
            self.hook.before_generation().await;
            run.model_calls += 1;
            let started = std::time::Instant::now();
            let generated = self.generator.generate(&req, ctx, &mut run.reports).await;
            self.hook.on_model_call(&match &generated {
                Ok(g) => ModelCall {
                    model: g.completion.model.clone(),
                    tokens_in: g.completion.usage.prompt_tokens,
                    tokens_out: g.completion.usage.completion_tokens,
                    estimated: g.completion.usage.estimated,
                    duration_ms: started.elapsed().as_millis() as u64,
                    first_token_ms: g.completion.first_token.map(|d| d.as_millis() as u64),
                    attempts: g.attempts,
                    outcome: if g.completion.tool_calls.is_empty() {
                        "ok".into()
                    } else {
                        "tool_calls".into()
                    },
                    tool_calls: g.completion.tool_calls.len(),
                    generation: run.thread.generation,
                    fallback: g.fallback_used.clone(),
                },
                Err(f) => ModelCall {
                    model: self.generator.client.config().model.clone(),
                    tokens_in: 0,
                    tokens_out: 0,
                    estimated: false,
                    duration_ms: started.elapsed().as_millis() as u64,
                    first_token_ms: None,
                    attempts: f.attempts,
                    outcome: f.error.class().to_string(),
                    tool_calls: 0,
                    generation: run.thread.generation,
                    fallback: None,
                },
            });
            let generated = generated.map_err(|f| match f.ineligible {
                // A refused generation retry ends the section attempt for
                // good: regenerating would repeat what was already shown or
                // done.
                Some(why) if why != leasehold_model::Ineligible::Cancelled => {
                    ModelError::RetryRefused {
                        why,
                        cause: f.error.to_string(),
                    }
                }
                Some(_) => ModelError::Cancelled,
                None => f.error,
            })?;
            if generated.fallback_used.is_some() {
                run.fallback_used = generated.fallback_used.clone();
            }
            let completion = generated.completion;
            let message = completion.message();
            run.thread.messages.push(message.clone());
            self.hook.on_message(run.thread.generation, &message);
            if completion.tool_calls.is_empty() {
                if let Some(fmt) = &self.policy.response_format {
                    if let Err(why) = validate_structured(fmt, &completion.content) {
                        if reasked {
                            return Err(ModelError::Malformed(why));
                        }
                        reasked = true;
                        let ask = Message::user(format!("Your reply failed validation: {why}. Reply again with only the corrected JSON."));
                        run.thread.messages.push(ask.clone());
                        self.hook.on_message(run.thread.generation, &ask);
                        continue;
                    }
                }
                return Ok(completion.content);
            }
            for call in &completion.tool_calls {
                if ctx.cancel.is_cancelled() {
                    return Err(ModelError::Cancelled);
                }
                let key = (
                    call.function.name.clone(),
                    canonical_args(&call.function.arguments),
                );
                let n = run.seen_calls.entry(key.clone()).or_insert(0);
                *n += 1;
                if *n >= 3 {
                    return Err(ModelError::Loop {
                        tool: key.0,
                        arguments: key.1,
                    });
                }
                ctx.budget
                    .lock()
                    .expect("budget lock")
                    .take_step()
                    .map_err(ModelError::Budget)?;
                let content =
                    match serde_json::from_str::<serde_json::Value>(&call.function.arguments) {
                        // Invalid arguments go back to the model as the result.
                        Err(e) => {
                            format!("error: invalid arguments for {}: {e}", call.function.name)
                        }
                        Ok(args) => {
                            run.tool_calls += 1;
                            let outcome = tokio::select! {
                                biased;
                                _ = ctx.cancel.cancelled() => return Err(ModelError::Cancelled),
                                o = self.tools.call(&call.function.name, &args, &call.id) => o,
                            };
                            match outcome {
                                ToolOutcome::Ok(s) => s,
                                ToolOutcome::Error(s) => format!("error: {s}"),
                                ToolOutcome::Failed(s) => {
                                    return Err(ModelError::ToolFailed {
                                        tool: call.function.name.clone(),
                                        message: s,
                                    })
                                }
                                ToolOutcome::Uncertain(s) => {
                                    return Err(ModelError::UncertainEffect {
                                        tool: call.function.name.clone(),
                                        message: s,
                                    })
                                }
                            }
                        }
                    };
                let result = Message::tool(call.id.clone(), content);
                run.thread.messages.push(result.clone());
                self.hook.on_message(run.thread.generation, &result);
            }
        }
        Err(ModelError::Loop {
            tool: "*".into(),
            arguments: format!(
                "no final answer after {} model responses",
                self.policy.max_rounds
            ),
        })
    }
}

fn finish(run: Run, outcome: SectionOutcome) -> SectionResult {
    SectionResult {
        outcome,
        reports: run.reports,
        thread: run.thread,
        model_calls: run.model_calls,
        tool_calls: run.tool_calls,
        fallback_used: run.fallback_used,
    }
}

/// Arguments with keys sorted at every level, so that `{"a":1,"b":2}` and
/// `{"b":2,"a":1}` count as the same call for loop detection. Text that is
/// not JSON is compared as is.
pub fn canonical_args(args: &str) -> String {
    fn canon(v: &serde_json::Value) -> String {
        match v {
            serde_json::Value::Object(map) => {
                let mut keys: Vec<_> = map.keys().collect();
                keys.sort();
                let parts: Vec<String> = keys
                    .into_iter()
                    .map(|k| {
                        format!(
                            "{}:{}",
                            serde_json::Value::String(k.clone()),
                            canon(&map[k])
                        )
                    })
                    .collect();
                format!("{{{}}}", parts.join(","))
            }
            serde_json::Value::Array(items) => format!(
                "[{}]",
                items.iter().map(canon).collect::<Vec<_>>().join(",")
            ),
            other => other.to_string(),
        }
    }
    serde_json::from_str::<serde_json::Value>(args)
        .map(|v| canon(&v))
        .unwrap_or_else(|_| args.trim().to_string())
}

/// Validates a final answer against the requested response format: JSON
/// that parses, and for a schema, an object with its top-level required keys.
fn validate_structured(format: &serde_json::Value, text: &str) -> Result<(), String> {
    let kind = format.get("type").and_then(|t| t.as_str()).unwrap_or("");
    if kind != "json_schema" && kind != "json_object" {
        return Ok(());
    }
    let value: serde_json::Value =
        serde_json::from_str(text.trim()).map_err(|e| format!("not valid JSON: {e}"))?;
    let schema = format.pointer("/json_schema/schema");
    if let Some(required) = schema
        .and_then(|s| s.get("required"))
        .and_then(|r| r.as_array())
    {
        let obj = value.as_object().ok_or("expected a JSON object")?;
        for key in required.iter().filter_map(|k| k.as_str()) {
            if !obj.contains_key(key) {
                return Err(format!("missing required property {key:?}"));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_args_ignore_key_order() {
        assert_eq!(
            canonical_args(r#"{"b":2,"a":{"y":1,"x":[1,2]}}"#),
            canonical_args(r#"{"a":{"x":[1,2],"y":1},"b":2}"#)
        );
    }

    #[test]
    fn structured_validation() {
        let f = serde_json::json!({"type":"json_schema","json_schema":{"name":"x","schema":{"type":"object","required":["title"]}}});
        assert!(validate_structured(&f, r#"{"title":"t"}"#).is_ok());
        assert!(validate_structured(&f, r#"{"x":1}"#).is_err());
        assert!(validate_structured(&f, "nope").is_err());
    }
}
