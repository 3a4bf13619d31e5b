//! The experts phase: each expert's sections written in order from its
//! first unrecorded one, at most `expert_concurrency` experts at once, a
//! failing expert stopping its siblings; a section whose journaled thread
//! already ends in its answer is not asked again.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use futures::StreamExt;
use leasehold::runtime::{AgentTools, Message, SectionInput, SectionOutcome, Thread};
use leasehold::telemetry::spans;
use leasehold::Error;
use serde_json::{json, Value};
use tracing::Instrument;

use crate::hooks::{Journal, ToolSink};
use crate::report;
use crate::state::{Resume, SectionCk};
use crate::{stop_of, Job};

impl Job<'_> {
    pub(crate) async fn experts_phase(&self) -> Result<Vec<SectionCk>, Error> {
        let ne = self.input.experts;
        let results: Vec<Result<Vec<SectionCk>, Error>> = futures::stream::iter(0..ne)
            .map(|e| async move {
                let r = self.expert(e).await;
                if r.is_err() {
                    self.work.cancel();
                }
                r
            })
            .buffer_unordered(self.cfg.expert_concurrency.max(1))
            .collect()
            .await;
        let mut out = Vec::new();
        let mut first: Option<Error> = None;
        for r in results {
            match r {
                Ok(v) => out.extend(v),
                // Prefer the real cause over the siblings' cancellations.
                Err(e @ Error::Cancelled) => {
                    first.get_or_insert(e);
                }
                Err(e) => {
                    if matches!(&first, None | Some(Error::Cancelled)) {
                        first = Some(e);
                    }
                }
            }
        }
        match first {
            Some(s) => Err(s),
            None => Ok(out),
        }
    }

    /// One expert's sections, in order, from its first unrecorded one.
    pub(crate) async fn expert(&self, e: usize) -> Result<Vec<SectionCk>, Error> {
        let outline = self.state.outline.as_ref().expect("outline");
        let experts = self.state.experts.as_ref().expect("experts");
        let expert = &experts[e];
        let mut summary = String::new();
        let mut out = Vec::new();
        for i in 0..self.input.sections {
            if let Some(s) = self.state.sections.get(&(e, i)) {
                summary = s.summary.clone();
                continue;
            }
            self.cancelled()?;
            let title = outline.sections[i].title.clone();
            let prompt = self.input.section_prompt(outline, expert, i);
            let journal = self.state.journals.get(&(e, i)).cloned();
            let (outcome, thread, model_calls, tool_calls) = match journal
                .as_ref()
                .and_then(|t| finished_answer(t, &prompt))
            {
                // The answer was journaled but its checkpoint was not: no call.
                Some(text) => (
                    SectionOutcome::Completed { text },
                    journal.clone().unwrap_or(Thread {
                        generation: 0,
                        messages: vec![],
                    }),
                    0,
                    0,
                ),
                None => {
                    let span = spans::section(i, &expert.name);
                    let tools = Arc::new(AgentTools {
                        toolbox: self.toolbox.clone(),
                        job_id: self.ctx.id().to_string(),
                        incarnation: self.ctx.record().created_at.clone(),
                        epoch: self.ctx.epoch(),
                        conversation: format!("e{e}.s{i}"),
                        offered: vec!["search".into(), "fetch".into()],
                        guard: self.owner.clone(),
                        events: Arc::new(ToolSink(self.flusher.clone())),
                    });
                    let hook = Arc::new(Journal {
                        flusher: self.flusher.clone(),
                        fp: self.fp.clone(),
                        expert: e,
                        index: i,
                        crash: self.crash.clone(),
                    });
                    let r = self
                        .section(
                            tools,
                            hook,
                            self.cfg.section_policy.clone(),
                            SectionInput {
                                system: report::SYSTEM.into(),
                                section_prompt: prompt,
                                rolling_context: summary.clone(),
                                initial: journal,
                            },
                            json!({"expert": e, "index": i}),
                        )
                        .instrument(span.clone())
                        .await;
                    match &r.outcome {
                        SectionOutcome::Completed { .. } => {
                            spans::record_outcome(&span, "completed")
                        }
                        SectionOutcome::Skipped { .. } => spans::record_outcome(&span, "skipped"),
                        _ => spans::record_error(&span, "stopped"),
                    }
                    (r.outcome, r.thread, r.model_calls, r.tool_calls)
                }
            };
            let ck = match outcome {
                SectionOutcome::Completed { text } => {
                    let mut sources = report::urls_in(&text);
                    for u in fetched_urls(&thread) {
                        if !sources.contains(&u) {
                            sources.push(u);
                        }
                    }
                    SectionCk {
                        expert: e,
                        index: i,
                        title: title.clone(),
                        status: "completed".into(),
                        summary: report::roll_summary(&summary, &title, Some(&text)),
                        content: text,
                        sources,
                        reason: None,
                        model_calls,
                        tool_calls,
                    }
                }
                SectionOutcome::Skipped { reason } => {
                    self.skipped.fetch_add(1, Ordering::SeqCst);
                    SectionCk {
                        expert: e,
                        index: i,
                        title: title.clone(),
                        status: "skipped".into(),
                        content: String::new(),
                        summary: report::roll_summary(&summary, &title, None),
                        sources: vec![],
                        reason: Some(reason),
                        model_calls,
                        tool_calls,
                    }
                }
                other => {
                    return Err(stop_of(
                        other,
                        &format!("section {} of {}", i + 1, expert.name),
                    ))
                }
            };
            summary = ck.summary.clone();
            self.flusher
                .event("section", json!({"v": self.fp, "payload": ck}));
            self.done.fetch_add(1, Ordering::SeqCst);
            self.progress(Resume::Experts);
            self.crash.section(&self.flusher).await;
            self.fresh.lock().expect("fresh sections").push(ck.clone());
            out.push(ck);
        }
        Ok(out)
    }
}

/// A journaled thread that already ends in the section's final answer.
fn finished_answer(t: &Thread, prompt: &str) -> Option<String> {
    let prompt_at = t
        .messages
        .iter()
        .rposition(|m| matches!(m, Message::User { content } if content == prompt))?;
    match t.messages.last()? {
        Message::Assistant {
            content: Some(c),
            tool_calls,
            refusal: None,
            partial: false,
        } if tool_calls.is_empty() && !c.trim().is_empty() && t.messages.len() > prompt_at + 1 => {
            Some(c.clone())
        }
        _ => None,
    }
}

/// URLs the section fetched (its sources even if the text cites none).
fn fetched_urls(t: &Thread) -> Vec<String> {
    t.messages
        .iter()
        .flat_map(|m| m.tool_calls().to_vec())
        .filter(|c| c.function.name == "fetch")
        .filter_map(|c| {
            serde_json::from_str::<Value>(&c.function.arguments)
                .ok()
                .and_then(|a| a["url"].as_str().map(str::to_string))
        })
        .collect()
}
