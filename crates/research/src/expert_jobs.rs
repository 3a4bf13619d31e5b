//! Research's experts as child jobs (input `"expert_jobs": true`).
//!
//! The report's job spawns one [`EXPERT_KIND`] job per expert, each retried,
//! budgeted and visible on its own, waits for them holding no worker, and
//! folds their sections into its state as if it had written them (the same
//! `section` checkpoints, so the final document, a resume and `watch` read
//! them as before). A child that did not complete leaves its expert's
//! sections skipped, with why: a child's failure is the report's gap, not
//! its end.
//!
//! An expert job runs the same section code as an in-process expert, from
//! its own checkpoints: its first attempt records the outline and the
//! perspectives it was given, so its resume is the report's resume.

use std::sync::atomic::Ordering;

use leasehold::{Error, Outcome};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::report;
use crate::state::{Expert, Outline, Resume, SectionCk};
use crate::Job;

/// The kind of an expert's child job.
pub const EXPERT_KIND: &str = "research-expert";

/// What an expert job is given (its input's `expert_job`, beside the
/// report's `topic`, `audience`, `experts` and `sections`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExpertTask {
    /// Which expert (0-based) of the perspectives.
    pub expert: usize,
    pub outline: Outline,
    pub perspectives: Vec<Expert>,
    /// The expert's share of the report's budget: the report's limits
    /// divided by its experts (the wall-clock limit as is).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<Limits>,
}

/// A budget's limits, as a submission writes them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_steps: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_wall_s: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_cost_usd: Option<f64>,
}

impl Limits {
    /// The limits of the job `ctx` runs, as its submission gave them.
    pub fn of_job(ctx: &leasehold::Ctx) -> Option<Limits> {
        let b = ctx.record().spec.as_ref()?.budget?;
        Some(Limits {
            max_steps: b.max_steps,
            max_tokens: b.max_tokens,
            max_wall_s: b.max_wall_s,
            max_cost_usd: b.max_cost_usd,
        })
    }

    /// One of `n` experts' share of `self`.
    pub fn share(self, n: usize) -> Limits {
        let n = n.max(1);
        Limits {
            max_steps: self.max_steps.map(|s| (s / n as u64).max(1)),
            max_tokens: self.max_tokens.map(|t| (t / n as u64).max(1)),
            max_wall_s: self.max_wall_s,
            max_cost_usd: self.max_cost_usd.map(|c| c / n as f64),
        }
    }

    fn is_empty(&self) -> bool {
        *self == Limits::default()
    }
}

impl ExpertTask {
    /// Checks the task against the input's counts.
    pub fn validate(&self, experts: usize, sections: usize) -> Result<(), String> {
        if self.expert >= experts {
            return Err(format!(
                "input.expert_job.expert: {} is not one of {experts} experts",
                self.expert
            ));
        }
        if self.perspectives.len() != experts {
            return Err(format!(
                "input.expert_job.perspectives: {} given for {experts} experts",
                self.perspectives.len()
            ));
        }
        if self.outline.sections.len() != sections {
            return Err(format!(
                "input.expert_job.outline: {} sections given for {sections}",
                self.outline.sections.len()
            ));
        }
        Ok(())
    }
}

/// The sections a child's outcome gives for expert `e`: its result's, or,
/// if it did not complete (or its result does not read), each section
/// skipped with why.
pub fn sections_of(o: &Outcome, e: usize, outline: &Outline) -> Vec<SectionCk> {
    let n = outline.sections.len();
    let got = match (o.status.as_str(), &o.result) {
        ("completed", Some(r)) => read_result(r, e, n).map_err(|why| {
            format!(
                "expert job {} completed with a result that does not read ({why})",
                o.id
            )
        }),
        _ => Err(match &o.error {
            Some(err) => format!(
                "expert job {} {}: {}: {}",
                o.id, o.status, err.class, err.message
            ),
            None => format!("expert job {} {}", o.id, o.status),
        }),
    };
    match got {
        Ok(v) => v,
        Err(reason) => {
            let mut summary = String::new();
            outline
                .sections
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    summary = report::roll_summary(&summary, &s.title, None);
                    SectionCk {
                        expert: e,
                        index: i,
                        title: s.title.clone(),
                        status: "skipped".into(),
                        content: String::new(),
                        summary: summary.clone(),
                        sources: vec![],
                        reason: Some(reason.clone()),
                        model_calls: 0,
                        tool_calls: 0,
                    }
                })
                .collect()
        }
    }
}

/// An expert job's result: every one of expert `e`'s `n` sections, once.
fn read_result(r: &Value, e: usize, n: usize) -> Result<Vec<SectionCk>, String> {
    let v: Vec<SectionCk> = serde_json::from_value(r.get("sections").cloned().unwrap_or_default())
        .map_err(|err| format!("sections: {err}"))?;
    let mut seen = vec![false; n];
    for s in &v {
        if s.expert != e || s.index >= n || std::mem::replace(&mut seen[s.index], true) {
            return Err(format!(
                "section ({}, {}) is not one of expert {e}'s {n}, once each",
                s.expert, s.index
            ));
        }
        s.validate(e + 1, n)?;
    }
    if seen.iter().any(|s| !s) {
        return Err(format!("{} of {n} sections", v.len()));
    }
    Ok(v)
}

impl Job<'_> {
    /// The experts phase with each expert a child job: spawned once (a
    /// durable step), joined holding no worker (the attempt ends with
    /// [`Error::Wait`] until the last child ends), folded into the state.
    pub(crate) async fn expert_jobs_phase(&self) -> Result<Vec<SectionCk>, Error> {
        let (ne, ns) = (self.input.experts, self.input.sections);
        if (0..ne).all(|e| (0..ns).all(|i| self.state.sections.contains_key(&(e, i)))) {
            return Ok(vec![]);
        }
        let outline = self.state.outline.clone().expect("outline");
        let experts = self.state.experts.clone().expect("experts");
        let budget = Limits::of_job(self.ctx)
            .filter(|l| !l.is_empty())
            .map(|l| l.share(ne));
        let inputs = (0..ne)
            .map(|e| {
                json!({
                    "topic": self.input.topic,
                    "audience": self.input.audience,
                    "experts": ne,
                    "sections": ns,
                    "expert_job": ExpertTask {
                        expert: e,
                        outline: outline.clone(),
                        perspectives: experts.clone(),
                        budget,
                    },
                })
            })
            .collect();
        let children = self.ctx.spawn_many(EXPERT_KIND, inputs).await?;
        let outcomes = self.ctx.join(&children).await?;
        let mut out = Vec::new();
        for (e, o) in outcomes.iter().enumerate() {
            for ck in sections_of(o, e, &outline) {
                if self.state.sections.contains_key(&(e, ck.index)) {
                    continue;
                }
                if !ck.completed() {
                    self.skipped.fetch_add(1, Ordering::SeqCst);
                }
                self.flusher
                    .event("section", json!({"v": self.fp, "payload": ck}));
                self.done.fetch_add(1, Ordering::SeqCst);
                self.fresh.lock().expect("fresh sections").push(ck.clone());
                out.push(ck);
            }
        }
        self.progress(Resume::Experts);
        Ok(out)
    }

    /// An expert job's whole run: the outline and perspectives it was
    /// given recorded as its own first checkpoints, then its expert's
    /// sections from the first unrecorded one. Its output is every one of
    /// them, for the report's job to fold.
    pub(crate) async fn expert_job(&mut self, task: &ExpertTask) -> Result<Value, Error> {
        if self.state.outline.as_ref() != Some(&task.outline) {
            self.state.outline = Some(task.outline.clone());
            self.checkpoint_phase("outline", json!(task.outline)).await;
        }
        if self.state.experts.as_ref() != Some(&task.perspectives) {
            self.state.experts = Some(task.perspectives.clone());
            self.checkpoint_phase("perspectives", json!(task.perspectives))
                .await;
        }
        self.progress(Resume::Experts);
        // Its share of the budget running out is a gap in the report, not
        // the loss of what it wrote: the sections left are skipped, why said.
        let ran_out = match crate::in_phase("experts", self.expert(task.expert)).await {
            Ok(_) => None,
            Err(Error::BudgetExhausted(m)) => Some(m),
            Err(e) => return Err(e),
        };
        let fresh = self.fresh.lock().expect("fresh sections").clone();
        let mut all: Vec<SectionCk> = self
            .state
            .sections
            .values()
            .filter(|s| s.expert == task.expert)
            .cloned()
            .chain(fresh)
            .collect();
        all.sort_by_key(|s| s.index);
        if let Some(m) = ran_out {
            let mut summary = all.last().map(|s| s.summary.clone()).unwrap_or_default();
            for (i, o) in task.outline.sections.iter().enumerate().skip(all.len()) {
                summary = report::roll_summary(&summary, &o.title, None);
                all.push(SectionCk {
                    expert: task.expert,
                    index: i,
                    title: o.title.clone(),
                    status: "skipped".into(),
                    content: String::new(),
                    summary: summary.clone(),
                    sources: vec![],
                    reason: Some(format!("this expert's job ran out of its budget ({m})")),
                    model_calls: 0,
                    tool_calls: 0,
                });
            }
        }
        Ok(json!({"expert": task.expert, "sections": all}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::OutlineSection;
    use leasehold::ChildError;

    fn outline(n: usize) -> Outline {
        Outline {
            title: "t".into(),
            sections: (0..n)
                .map(|i| OutlineSection {
                    title: format!("s{i}"),
                    goal: "g".into(),
                })
                .collect(),
        }
    }

    fn section(e: usize, i: usize) -> SectionCk {
        SectionCk {
            expert: e,
            index: i,
            title: format!("s{i}"),
            status: "completed".into(),
            content: "text".into(),
            summary: String::new(),
            sources: vec![],
            reason: None,
            model_calls: 1,
            tool_calls: 0,
        }
    }

    fn outcome(status: &str, result: Option<Value>) -> Outcome {
        Outcome {
            id: "r_abc_1".into(),
            kind: EXPERT_KIND.into(),
            status: status.into(),
            result,
            error: (status != "completed").then(|| ChildError {
                class: "terminal".into(),
                message: "no model".into(),
            }),
        }
    }

    #[test]
    fn a_completed_expert_job_gives_its_sections() {
        let r = json!({"expert": 1, "sections": [section(1, 0), section(1, 1)]});
        let got = sections_of(&outcome("completed", Some(r)), 1, &outline(2));
        assert_eq!(got, vec![section(1, 0), section(1, 1)]);
    }

    #[test]
    fn a_failed_expert_job_leaves_its_sections_skipped_with_why() {
        let got = sections_of(&outcome("failed", None), 0, &outline(3));
        assert_eq!(got.len(), 3);
        assert!(got.iter().all(|s| !s.completed()));
        assert_eq!(
            got[2].reason.as_deref(),
            Some("expert job r_abc_1 failed: terminal: no model")
        );
    }

    #[test]
    fn a_result_missing_or_repeating_a_section_is_not_taken() {
        for r in [
            json!({"sections": [section(0, 0)]}),
            json!({"sections": [section(0, 0), section(0, 0)]}),
            json!({"sections": [section(1, 0), section(0, 1)]}),
            json!({"sections": "no"}),
        ] {
            let got = sections_of(&outcome("completed", Some(r.clone())), 0, &outline(2));
            assert!(got.iter().all(|s| !s.completed()), "{r}");
            assert!(got[0].reason.as_deref().unwrap().contains("does not read"));
        }
    }

    #[test]
    fn a_share_divides_all_but_the_wall() {
        let l = Limits {
            max_steps: Some(10),
            max_tokens: Some(1000),
            max_wall_s: Some(60.0),
            max_cost_usd: Some(0.3),
        };
        let s = l.share(3);
        assert_eq!(s.max_steps, Some(3));
        assert_eq!(s.max_tokens, Some(333));
        assert_eq!(s.max_wall_s, Some(60.0));
        assert!((s.max_cost_usd.unwrap() - 0.1).abs() < 1e-9);
        assert_eq!(
            Limits {
                max_steps: Some(2),
                ..Limits::default()
            }
            .share(3)
            .max_steps,
            Some(1)
        );
    }

    #[test]
    fn a_task_must_fit_the_input() {
        let t = ExpertTask {
            expert: 2,
            outline: outline(4),
            perspectives: vec![
                Expert {
                    name: "a".into(),
                    focus: "f".into()
                };
                3
            ],
            budget: None,
        };
        assert!(t.validate(3, 4).is_ok());
        assert!(t.validate(2, 4).unwrap_err().contains("expert"));
        assert!(t.validate(3, 5).unwrap_err().contains("outline"));
    }
}
