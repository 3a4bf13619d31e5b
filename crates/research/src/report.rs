//! Prompts, response schemas, rolling summaries, sources and the final
//! Markdown document. Pure functions: the same checkpoints give the same text.

use std::collections::BTreeMap;

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::expert_jobs::ExpertTask;
use crate::state::{Expert, FinalCk, Outline, SectionCk};

pub const SYSTEM: &str =
    "You are a careful research assistant. Cite the sources you used. Never invent sources.";

const OUTLINE_PROMPT: &str = "{topic}: create an outline for a research report on \"{topic}\" for {audience}: exactly {n} sections, each with a title and the goal it serves.";
const PERSPECTIVES_PROMPT: &str = "{topic}: choose {n} expert perspectives for a research report on \"{topic}\" for {audience}: each expert has a name and a focus.";
const SECTION_PROMPT: &str = "{title}: research and write section {i} of {n} of a report on \"{topic}\" as {expert} (focus: {focus}). Goal: {goal}. Use search and fetch, and cite what you read.";
const FINAL_PROMPT: &str = "{title}: write section {i} of {n} of the final report on \"{topic}\" for {audience}, combining the expert contributions in the context. Goal: {goal}. Keep their citations.";

/// A digest of every prompt template: the `prompt` version.
pub fn prompt_version() -> String {
    let mut h = Sha256::new();
    for t in [
        SYSTEM,
        OUTLINE_PROMPT,
        PERSPECTIVES_PROMPT,
        SECTION_PROMPT,
        FINAL_PROMPT,
    ] {
        h.update(t.as_bytes());
        h.update([0]);
    }
    hex::encode(h.finalize())[..12].to_string()
}

fn fill(t: &str, vars: &[(&str, String)]) -> String {
    vars.iter()
        .fold(t.to_string(), |s, (k, v)| s.replace(&format!("{{{k}}}"), v))
}

/// The job's input, with defaults applied.
#[derive(Debug, Clone)]
pub struct Input {
    pub topic: String,
    pub experts: usize,
    pub sections: usize,
    pub audience: String,
    /// Each expert a child job of its own (`expert_jobs`).
    pub expert_jobs: bool,
    /// An expert job's task (`expert_job`): only the `research-expert`
    /// kind's input has one.
    pub task: Option<ExpertTask>,
}

impl Input {
    pub fn parse(v: &Value) -> Result<Input, String> {
        let topic = v
            .get("topic")
            .and_then(Value::as_str)
            .filter(|t| !t.trim().is_empty())
            .ok_or("input.topic: required")?
            .to_string();
        let n = |k: &str, d: u64, max: u64| -> Result<usize, String> {
            match v.get(k) {
                None | Some(Value::Null) => Ok(d as usize),
                Some(x) => x
                    .as_u64()
                    .filter(|n| (1..=max).contains(n))
                    .map(|n| n as usize)
                    .ok_or(format!("input.{k}: expected 1..={max}, got {x}")),
            }
        };
        let expert_jobs = match v.get("expert_jobs") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(x) => {
                return Err(format!(
                    "input.expert_jobs: expected true or false, got {x}"
                ))
            }
        };
        let (experts, sections) = (n("experts", 3, 8)?, n("sections", 4, 12)?);
        let task = match v.get("expert_job") {
            None | Some(Value::Null) => None,
            Some(t) => {
                let t: ExpertTask = serde_json::from_value(t.clone())
                    .map_err(|e| format!("input.expert_job: {e}"))?;
                t.validate(experts, sections)?;
                Some(t)
            }
        };
        Ok(Input {
            topic,
            experts,
            sections,
            audience: v
                .get("audience")
                .and_then(Value::as_str)
                .unwrap_or("a technical audience")
                .to_string(),
            expert_jobs,
            task,
        })
    }

    fn base(&self) -> Vec<(&'static str, String)> {
        vec![
            ("topic", self.topic.clone()),
            ("audience", self.audience.clone()),
        ]
    }

    pub fn outline_prompt(&self) -> String {
        let mut v = self.base();
        v.push(("n", self.sections.to_string()));
        fill(OUTLINE_PROMPT, &v)
    }

    pub fn perspectives_prompt(&self) -> String {
        let mut v = self.base();
        v.push(("n", self.experts.to_string()));
        fill(PERSPECTIVES_PROMPT, &v)
    }

    pub fn section_prompt(&self, o: &Outline, e: &Expert, i: usize) -> String {
        let s = &o.sections[i];
        let mut v = self.base();
        v.extend([
            ("i", (i + 1).to_string()),
            ("n", self.sections.to_string()),
            ("title", s.title.clone()),
            ("goal", s.goal.clone()),
            ("expert", e.name.clone()),
            ("focus", e.focus.clone()),
        ]);
        fill(SECTION_PROMPT, &v)
    }

    pub fn final_prompt(&self, o: &Outline, i: usize) -> String {
        let s = &o.sections[i];
        let mut v = self.base();
        v.extend([
            ("i", (i + 1).to_string()),
            ("n", self.sections.to_string()),
            ("title", s.title.clone()),
            ("goal", s.goal.clone()),
        ]);
        fill(FINAL_PROMPT, &v)
    }
}

fn schema(name: &str, key: &str, n: usize, item: Value) -> Value {
    json!({"type": "json_schema", "json_schema": {"name": name, "strict": true, "schema": {
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            key: {"type": "array", "minItems": n, "maxItems": n, "items": item}
        },
        "required": ["title", key],
        "additionalProperties": false
    }}})
}

pub fn outline_format(n: usize) -> Value {
    schema(
        "outline",
        "sections",
        n,
        json!({"type": "object", "properties": {"title": {"type": "string"}, "goal": {"type": "string"}}, "required": ["title", "goal"], "additionalProperties": false}),
    )
}

pub fn perspectives_format(n: usize) -> Value {
    schema(
        "perspectives",
        "experts",
        n,
        json!({"type": "object", "properties": {"name": {"type": "string"}, "focus": {"type": "string"}}, "required": ["name", "focus"], "additionalProperties": false}),
    )
}

/// The first sentence-ish of a text, bounded, without headings.
fn gist(text: &str, max: usize) -> String {
    let body: String = text
        .lines()
        .filter(|l| !l.trim_start().starts_with('#') && !l.trim().is_empty())
        .collect::<Vec<_>>()
        .join(" ");
    let end = body.find(". ").map_or(body.len(), |i| i + 1);
    let mut s: String = body[..end].chars().take(max).collect();
    if s.len() < body[..end].len() {
        s.push('…');
    }
    s
}

/// The rolling summary after a section: the one before plus this section's gist.
pub fn roll_summary(prev: &str, title: &str, content: Option<&str>) -> String {
    let line = match content {
        Some(c) => format!("- {title}: {}", gist(c, 240)),
        None => format!("- {title}: (skipped)"),
    };
    if prev.is_empty() {
        line
    } else {
        format!("{prev}\n{line}")
    }
}

/// URLs cited in a text (Markdown links and bare `http(s)://`).
pub fn urls_in(text: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for (i, _) in text.match_indices("http") {
        let rest = &text[i..];
        if !(rest.starts_with("http://") || rest.starts_with("https://")) {
            continue;
        }
        let end = rest
            .find(|c: char| c.is_whitespace() || matches!(c, ')' | ']' | '>' | '"' | '\''))
            .unwrap_or(rest.len());
        let u = rest[..end].trim_end_matches(['.', ',', ';']).to_string();
        if !out.contains(&u) {
            out.push(u);
        }
    }
    out
}

/// The expert contributions to one outline section, as the synthesis context.
pub fn contributions(experts: &[Expert], secs: &[&SectionCk]) -> String {
    secs.iter()
        .filter(|s| s.completed())
        .map(|s| {
            format!(
                "### Contribution of {} ({})\n{}",
                experts[s.expert].name, experts[s.expert].focus, s.content
            )
        })
        .collect::<Vec<_>>()
        .join("\n\n")
}

/// The text of a final section no expert could research.
pub fn missing_section(title: &str, secs: &[&SectionCk], experts: &[Expert]) -> String {
    let reasons: Vec<String> = secs
        .iter()
        .map(|s| {
            format!(
                "{}: {}",
                experts[s.expert].name,
                s.reason.as_deref().unwrap_or("skipped")
            )
        })
        .collect();
    format!(
        "**This section is missing.** No expert could research \"{title}\"; every attempt was skipped after its retries were exhausted ({}). Nothing here is invented to fill the gap.",
        reasons.join("; ")
    )
}

/// The expert notes verbatim, when the synthesis itself was skipped.
pub fn unsynthesized(experts: &[Expert], secs: &[&SectionCk], why: &str) -> String {
    format!(
        "_The synthesis of this section was skipped ({why}); the experts' notes follow unedited._\n\n{}",
        contributions(experts, secs)
    )
}

/// Recovery facts for the appendix.
#[derive(Debug, Default)]
pub struct Recovery {
    pub claims: u32,
    pub stale_reclaims: u32,
    pub attempts: u32,
    /// Retry events by scope (`generation`, `warm`, `cold`, `job`), eligible only.
    pub retries: BTreeMap<String, u32>,
    pub refused_retries: u32,
    pub notes: Vec<String>,
}

impl Recovery {
    /// Claims and retries counted from a job's events (every epoch).
    pub fn counted(events: &[(u64, leasehold::JobEvent)]) -> Recovery {
        let mut r = Recovery::default();
        for (_, ev) in events {
            match ev.r#type.as_str() {
                "claimed" => r.claims += 1,
                "retry" => {
                    let d = ev.data_map();
                    if d.get("eligible").and_then(serde_json::Value::as_bool) == Some(false) {
                        r.refused_retries += 1;
                    } else {
                        let scope = d
                            .get("scope")
                            .and_then(serde_json::Value::as_str)
                            .unwrap_or("?");
                        *r.retries.entry(scope.to_string()).or_default() += 1;
                    }
                }
                _ => {}
            }
        }
        r
    }
}

/// Everything the document is made of.
pub struct Doc<'a> {
    pub input: &'a Input,
    pub outline: &'a Outline,
    pub experts: &'a [Expert],
    pub sections: &'a BTreeMap<(usize, usize), SectionCk>,
    pub finals: &'a BTreeMap<usize, FinalCk>,
    pub skipped: &'a [String],
    pub recovery: &'a Recovery,
}

/// The Markdown of a job that stopped before its final document (cancelled,
/// or its budget ran out): what was written, section by section (the final
/// text where there is one, else each expert's section), under a banner
/// that says why and how much. Never delivered; kept as `<id>/partial.md`.
pub fn partial_document(d: &Doc<'_>, why: &str) -> String {
    let done = d.sections.values().filter(|s| s.completed()).count();
    let total = d.outline.sections.len() * d.experts.len();
    let mut out = format!(
        "# {}

",
        d.outline.title.trim()
    );
    out.push_str(&format!(
        "> **Partial report: {why}.** {done} of {total} expert section(s) and {} of {} final section(s) were written; the rest were not.\n\n",
        d.finals.len(),
        d.outline.sections.len()
    ));
    for (i, s) in d.outline.sections.iter().enumerate() {
        out.push_str(&format!("## {}. {}\n\n", i + 1, s.title.trim()));
        if let Some(f) = d.finals.get(&i) {
            out.push_str(f.content.trim());
            out.push_str("\n\n");
            continue;
        }
        let mut any = false;
        for (e, expert) in d.experts.iter().enumerate() {
            if let Some(ck) = d.sections.get(&(e, i)).filter(|c| c.completed()) {
                any = true;
                out.push_str(&format!("### {} ({})\n\n", expert.name, expert.focus));
                for line in ck.content.trim().lines() {
                    if line.starts_with('#') {
                        out.push_str("##");
                    }
                    out.push_str(line);
                    out.push('\n');
                }
                out.push('\n');
            }
        }
        if !any {
            out.push_str("_Not written._\n\n");
        }
    }
    out
}

/// The final Markdown.
pub fn document(d: &Doc<'_>) -> String {
    let mut out = format!("# {}\n\n", d.outline.title.trim());
    out.push_str(&format!(
        "_A research report on \"{}\" for {}, written from {} expert perspectives: {}._\n\n",
        d.input.topic,
        d.input.audience,
        d.experts.len(),
        d.experts
            .iter()
            .map(|e| format!("{} ({})", e.name, e.focus))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    if !d.skipped.is_empty() {
        out.push_str(&format!(
            "> **Partial report.** {} expert section(s) were skipped after exhausting their retries: {}. See the appendix.\n\n",
            d.skipped.len(),
            d.skipped.join("; ")
        ));
    }
    for (i, s) in d.outline.sections.iter().enumerate() {
        out.push_str(&format!("## {}. {}\n\n", i + 1, s.title.trim()));
        if let Some(f) = d.finals.get(&i) {
            // Demote the model's own headings below the section heading.
            for line in f.content.trim().lines() {
                if line.starts_with('#') {
                    out.push('#');
                }
                out.push_str(line);
                out.push('\n');
            }
        }
        out.push('\n');
    }
    out.push_str("## Appendix A: Sources\n\n");
    let mut any = false;
    for ((e, i), s) in d.sections {
        for u in &s.sources {
            any = true;
            out.push_str(&format!(
                "- <{u}> ({}, section {})\n",
                d.experts.get(*e).map_or("?", |x| x.name.as_str()),
                i + 1
            ));
        }
    }
    if !any {
        out.push_str("- none recorded\n");
    }
    let r = d.recovery;
    out.push_str("\n## Appendix B: Recovery\n\n");
    out.push_str(&format!(
        "- Claims: {} (stale reclaims after a lost worker: {}; failed attempts: {})\n",
        r.claims, r.stale_reclaims, r.attempts
    ));
    let retries = if r.retries.is_empty() {
        "none".to_string()
    } else {
        r.retries
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    out.push_str(&format!(
        "- Retries: {retries} (refused: {})\n",
        r.refused_retries
    ));
    let done: Vec<&SectionCk> = d.sections.values().filter(|s| s.completed()).collect();
    let without = done.iter().filter(|s| s.tool_calls == 0).count();
    if without > 0 {
        // A provider without tool calling (or LH_MODEL_TOOLS=none) writes
        // sections from what the model knows: the reader should know.
        out.push_str(&format!(
            "- Sections written without tools (no search or fetch): {without} of {}\n",
            done.len()
        ));
    }
    if d.skipped.is_empty() {
        out.push_str("- Skipped sections: none\n");
    } else {
        out.push_str("- Skipped sections:\n");
        for ((e, i), s) in d.sections.iter().filter(|(_, s)| !s.completed()) {
            out.push_str(&format!(
                "  - section {} \"{}\" by {}: {}\n",
                i + 1,
                s.title,
                d.experts.get(*e).map_or("?", |x| x.name.as_str()),
                s.reason.as_deref().unwrap_or("skipped")
            ));
        }
    }
    for n in &r.notes {
        out.push_str(&format!("- {n}\n"));
    }
    out
}

pub fn sha256_hex(text: &str) -> String {
    hex::encode(Sha256::digest(text.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summaries_roll_and_urls_are_found() {
        let s = roll_summary("", "A", Some("## A\n\nFirst point. Second."));
        assert_eq!(s, "- A: First point.");
        let s = roll_summary(&s, "B", None);
        assert!(s.ends_with("- B: (skipped)"));
        assert_eq!(
            urls_in("Source: [http://x/page/a](http://x/page/a). and https://y/z"),
            vec!["http://x/page/a", "https://y/z"]
        );
    }

    #[test]
    fn a_section_no_expert_wrote_says_so() {
        let input = Input::parse(&json!({"topic": "leases", "experts": 2, "sections": 1})).unwrap();
        let outline = Outline {
            title: "Leases".into(),
            sections: vec![crate::state::OutlineSection {
                title: "Fencing".into(),
                goal: "g".into(),
            }],
        };
        let experts = vec![
            Expert {
                name: "A".into(),
                focus: "f".into(),
            },
            Expert {
                name: "B".into(),
                focus: "f".into(),
            },
        ];
        let skipped = |e| SectionCk {
            expert: e,
            index: 0,
            title: "Fencing".into(),
            status: "skipped".into(),
            content: String::new(),
            summary: String::new(),
            sources: vec![],
            reason: Some("retries exhausted".into()),
            model_calls: 5,
            tool_calls: 0,
        };
        let sections: BTreeMap<_, _> = [((0, 0), skipped(0)), ((1, 0), skipped(1))].into();
        let secs: Vec<&SectionCk> = sections.values().collect();
        let finals: BTreeMap<_, _> = [(
            0,
            FinalCk {
                index: 0,
                content: missing_section("Fencing", &secs, &experts),
                missing: true,
                unsynthesized: false,
            },
        )]
        .into();
        let skipped_list = vec!["1. Fencing (A)".to_string(), "1. Fencing (B)".to_string()];
        let doc = document(&Doc {
            input: &input,
            outline: &outline,
            experts: &experts,
            sections: &sections,
            finals: &finals,
            skipped: &skipped_list,
            recovery: &Recovery::default(),
        });
        assert!(doc.contains("**Partial report.** 2 expert section(s)"));
        assert!(doc.contains("**This section is missing.**"));
        assert!(doc.contains("A: retries exhausted; B: retries exhausted"));
        assert!(doc.contains("  - section 1 \"Fencing\" by B: retries exhausted"));
    }

    #[test]
    fn input_defaults_and_prompts() {
        let i = Input::parse(&json!({"topic": "leases"})).unwrap();
        assert_eq!((i.experts, i.sections), (3, 4));
        assert!(i.outline_prompt().contains("exactly 4 sections"));
        assert!(Input::parse(&json!({"topic": "x", "experts": 0})).is_err());
        assert_eq!(prompt_version().len(), 12);
    }
}
