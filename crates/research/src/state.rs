//! Typed checkpoint state, rebuilt from a job's events on every run.
//!
//! Checkpoints are events (`phase`, `section`, `journal`) carrying the run's
//! version fingerprint `v`. The rebuild trusts only what it can validate:
//! events from fenced-off epochs are dropped first (as
//! the store's `events::coherent` does), events
//! under another fingerprint are ignored (a different prompt, model or tool
//! set produced them), and every payload is checked against the job's input
//! (section and expert counts) before it is used. Downstream state belongs to
//! the upstream checkpoint it follows: a newer (or invalid) outline discards
//! the perspectives, sections and final sections recorded before it, so a
//! walk-back never mixes two lineages.

use std::collections::{BTreeMap, HashMap};

use leasehold::runtime::{Message, Thread};
use leasehold::JobEvent;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// One section of the outline.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OutlineSection {
    pub title: String,
    pub goal: String,
}

/// The validated outline.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Outline {
    pub title: String,
    pub sections: Vec<OutlineSection>,
}

/// One expert of the perspectives phase.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Expert {
    pub name: String,
    pub focus: String,
}

/// A completed or skipped expert section (the `section` event's payload).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SectionCk {
    pub expert: usize,
    pub index: usize,
    pub title: String,
    /// `completed` or `skipped`.
    pub status: String,
    #[serde(default)]
    pub content: String,
    /// The rolling summary after this section (input of the next one).
    #[serde(default)]
    pub summary: String,
    #[serde(default)]
    pub sources: Vec<String>,
    #[serde(default)]
    pub reason: Option<String>,
    #[serde(default)]
    pub model_calls: u32,
    #[serde(default)]
    pub tool_calls: u32,
}

impl SectionCk {
    pub fn completed(&self) -> bool {
        self.status == "completed"
    }

    pub(crate) fn validate(&self, experts: usize, sections: usize) -> Result<(), String> {
        if self.expert >= experts || self.index >= sections {
            return Err(format!(
                "section ({}, {}) is outside {experts} experts x {sections} sections",
                self.expert, self.index
            ));
        }
        match self.status.as_str() {
            "completed" if !self.content.trim().is_empty() => Ok(()),
            "completed" => Err("completed section without content".into()),
            "skipped" => Ok(()),
            s => Err(format!("unknown section status {s:?}")),
        }
    }
}

/// A final-document section (the `phase` event with `phase: final`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FinalCk {
    pub index: usize,
    pub content: String,
    /// True when no expert content existed and the text says so.
    #[serde(default)]
    pub missing: bool,
    /// True when the synthesis was skipped and the expert notes were used as is.
    #[serde(default)]
    pub unsynthesized: bool,
}

/// The stored artifact (`phase: artifact`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ArtifactCk {
    pub name: String,
    pub digest: String,
}

/// What the events prove, typed.
#[derive(Debug, Default)]
pub struct State {
    pub outline: Option<Outline>,
    pub experts: Option<Vec<Expert>>,
    pub sections: HashMap<(usize, usize), SectionCk>,
    /// In-flight section transcripts: the last thread plus the messages after it.
    pub journals: HashMap<(usize, usize), Thread>,
    /// Stream sequence of the perspectives checkpoint in force, and of each
    /// expert's last section checkpoint: where the journal of the sections
    /// still in flight can start (see [`State::journal_from`]).
    experts_seq: Option<u64>,
    section_seq: HashMap<usize, u64>,
    pub finals: BTreeMap<usize, FinalCk>,
    pub artifact: Option<ArtifactCk>,
    /// Why something was not reused (invalid, other version), for the appendix.
    pub notes: Vec<String>,
}

/// A journal entry's payload.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum JournalOp {
    /// The thread was (re)started or repaired: replaces everything before.
    Thread {
        generation: u32,
        messages: Vec<Message>,
    },
    /// One complete model response or tool result.
    Message { generation: u32, message: Message },
}

/// Where the run resumes; ordered from the start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Resume {
    Outline,
    Perspectives,
    Experts,
    Final,
    Publish,
}

impl Resume {
    pub fn as_str(self) -> &'static str {
        match self {
            Resume::Outline => "outline",
            Resume::Perspectives => "perspectives",
            Resume::Experts => "experts",
            Resume::Final => "final",
            Resume::Publish => "publish",
        }
    }

    pub fn parse(s: &str) -> Option<Resume> {
        Some(match s {
            "outline" => Resume::Outline,
            "perspectives" => Resume::Perspectives,
            "experts" => Resume::Experts,
            "final" => Resume::Final,
            "publish" => Resume::Publish,
            _ => return None,
        })
    }
}

/// Validates an outline payload against the wanted section count.
pub fn validate_outline(v: &Value, sections: usize) -> Result<Outline, String> {
    let o: Outline = serde_json::from_value(v.clone()).map_err(|e| format!("outline: {e}"))?;
    if o.sections.len() != sections {
        return Err(format!(
            "outline has {} sections, the job asks for {sections}",
            o.sections.len()
        ));
    }
    if o.sections.iter().any(|s| s.title.trim().is_empty()) {
        return Err("outline has a section without a title".into());
    }
    Ok(o)
}

/// Validates a perspectives payload against the wanted expert count.
pub fn validate_experts(v: &Value, experts: usize) -> Result<Vec<Expert>, String> {
    let e: Vec<Expert> =
        serde_json::from_value(v.clone()).map_err(|e| format!("perspectives: {e}"))?;
    if e.len() != experts {
        return Err(format!(
            "perspectives name {} experts, the job asks for {experts}",
            e.len()
        ));
    }
    if e.iter().any(|x| x.name.trim().is_empty()) {
        return Err("perspectives have an expert without a name".into());
    }
    Ok(e)
}

impl State {
    /// Rebuilds the state from a job's events (in stream order).
    pub fn rebuild(events: &[(u64, JobEvent)], fp: &str, experts: usize, sections: usize) -> State {
        let mut st = State::default();
        let mut foreign = 0usize;
        // The coherent events (see the store's `events::coherent`),
        // with their sequences.
        let mut current = 0;
        for (seq, ev) in events {
            if ev.r#type == "claimed" {
                current = current.max(ev.epoch);
            }
            if ev.epoch < current {
                continue;
            }
            let ty = ev.r#type.as_str();
            if !matches!(ty, "phase" | "section" | "journal") {
                continue;
            }
            let data = ev.data_map();
            if data.get("v").and_then(Value::as_str) != Some(fp) {
                foreign += 1;
                continue;
            }
            match ty {
                "phase" => {
                    st.apply_phase(&data, experts, sections);
                    if data.get("phase").and_then(Value::as_str) == Some("perspectives") {
                        st.experts_seq = st.experts.is_some().then_some(*seq);
                        st.section_seq.clear();
                    }
                    if data.get("phase").and_then(Value::as_str) == Some("outline") {
                        st.experts_seq = None;
                        st.section_seq.clear();
                    }
                }
                "section" => {
                    let key = data
                        .get("payload")
                        .and_then(|p| p.get("expert"))
                        .and_then(Value::as_u64);
                    st.apply_section(&data, experts, sections);
                    if let Some(e) = key {
                        st.section_seq.insert(e as usize, *seq);
                    }
                }
                _ => st.apply_journal(&data),
            }
        }
        if foreign > 0 {
            st.notes.push(format!(
                "{foreign} checkpoint events of another version (workflow, prompt, model or tools) were not reused"
            ));
        }
        st
    }

    fn clear_from_experts(&mut self) {
        self.sections.clear();
        self.journals.clear();
        self.finals.clear();
        self.artifact = None;
    }

    fn apply_phase(&mut self, d: &serde_json::Map<String, Value>, experts: usize, sections: usize) {
        let phase = d.get("phase").and_then(Value::as_str).unwrap_or("");
        let payload = d.get("payload").cloned().unwrap_or(Value::Null);
        match phase {
            "outline" => {
                self.experts = None;
                self.clear_from_experts();
                match validate_outline(&payload, sections) {
                    Ok(o) => self.outline = Some(o),
                    Err(why) => {
                        self.outline = None;
                        self.notes
                            .push(format!("outline checkpoint invalid ({why}): walked back"));
                    }
                }
            }
            "perspectives" if self.outline.is_some() => {
                self.clear_from_experts();
                match validate_experts(&payload, experts) {
                    Ok(e) => self.experts = Some(e),
                    Err(why) => {
                        self.experts = None;
                        self.notes.push(format!(
                            "perspectives checkpoint invalid ({why}): walked back"
                        ));
                    }
                }
            }
            "final" if self.experts.is_some() => match serde_json::from_value::<FinalCk>(payload) {
                Ok(f) if f.index < sections && !f.content.trim().is_empty() => {
                    self.finals.insert(f.index, f);
                }
                Ok(f) => self
                    .notes
                    .push(format!("final section {} checkpoint invalid", f.index + 1)),
                Err(e) => self
                    .notes
                    .push(format!("final section checkpoint unreadable: {e}")),
            },
            "artifact" if self.experts.is_some() => {
                if let Ok(a) = serde_json::from_value::<ArtifactCk>(payload) {
                    self.artifact = Some(a);
                }
            }
            _ => {}
        }
    }

    fn apply_section(
        &mut self,
        d: &serde_json::Map<String, Value>,
        experts: usize,
        sections: usize,
    ) {
        if self.experts.is_none() {
            return;
        }
        let payload = d.get("payload").cloned().unwrap_or(Value::Null);
        match serde_json::from_value::<SectionCk>(payload) {
            Ok(s) => match s.validate(experts, sections) {
                Ok(()) => {
                    let key = (s.expert, s.index);
                    self.journals.remove(&key);
                    self.sections.insert(key, s);
                }
                Err(why) => self
                    .notes
                    .push(format!("section checkpoint ignored: {why}")),
            },
            Err(e) => self
                .notes
                .push(format!("section checkpoint unreadable: {e}")),
        }
    }

    fn apply_journal(&mut self, d: &serde_json::Map<String, Value>) {
        if self.experts.is_none() {
            return;
        }
        let (Some(e), Some(i)) = (
            d.get("expert").and_then(Value::as_u64),
            d.get("index").and_then(Value::as_u64),
        ) else {
            return;
        };
        let key = (e as usize, i as usize);
        if self.sections.contains_key(&key) {
            return;
        }
        let Some(op) = d
            .get("entry")
            .and_then(|v| serde_json::from_value::<JournalOp>(v.clone()).ok())
        else {
            return;
        };
        match op {
            JournalOp::Thread {
                generation,
                messages,
            } => {
                self.journals.insert(
                    key,
                    Thread {
                        generation,
                        messages,
                    },
                );
            }
            JournalOp::Message {
                generation,
                message,
            } => {
                if let Some(t) = self.journals.get_mut(&key) {
                    if t.generation == generation {
                        t.messages.push(message);
                    }
                }
            }
        }
    }

    /// Where a resume must start reading the journal: only the sections
    /// still in flight need it, and each of those began after its expert's
    /// last section checkpoint (or the perspectives checkpoint). `None`:
    /// no section is in flight, no journal is needed.
    pub fn journal_from(&self, experts: usize, sections: usize) -> Option<u64> {
        let base = self.experts_seq?;
        (0..experts)
            .filter(|e| (0..sections).any(|i| !self.sections.contains_key(&(*e, i))))
            .map(|e| self.section_seq.get(&e).copied().unwrap_or(base))
            .min()
    }

    /// The earliest phase that can run safely, given what is valid.
    pub fn resume_point(&self, experts: usize, sections: usize) -> Resume {
        if self.outline.is_none() {
            return Resume::Outline;
        }
        if self.experts.is_none() {
            return Resume::Perspectives;
        }
        if self.sections.len() < experts * sections {
            return Resume::Experts;
        }
        if self.finals.len() < sections {
            return Resume::Final;
        }
        Resume::Publish
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ev(seq: u64, epoch: u64, ty: &str, data: Value) -> (u64, JobEvent) {
        (
            seq,
            JobEvent {
                job_id: "j".into(),
                epoch,
                at: "2026-12-01T00:00:00Z".into(),
                r#type: ty.into(),
                worker_id: Some("w".into()),
                data: data.to_string(),
            },
        )
    }

    fn outline(n: usize) -> Value {
        json!({"title": "t", "sections": (0..n).map(|i| json!({"title": format!("s{i}"), "goal": "g"})).collect::<Vec<_>>()})
    }

    fn experts(n: usize) -> Value {
        json!((0..n)
            .map(|i| json!({"name": format!("e{i}"), "focus": "f"}))
            .collect::<Vec<_>>())
    }

    fn section(e: usize, i: usize, content: &str) -> Value {
        json!({"v": "fp", "payload": {"expert": e, "index": i, "title": "x", "status": "completed", "content": content, "summary": "s"}})
    }

    #[test]
    fn rebuilds_and_walks_back_on_invalid_outline() {
        let mut evs = vec![
            ev(1, 1, "claimed", json!({})),
            ev(
                2,
                1,
                "phase",
                json!({"v": "fp", "phase": "outline", "payload": outline(2)}),
            ),
            ev(
                3,
                1,
                "phase",
                json!({"v": "fp", "phase": "perspectives", "payload": experts(2)}),
            ),
            ev(4, 1, "section", section(0, 0, "c")),
        ];
        let st = State::rebuild(&evs, "fp", 2, 2);
        assert_eq!(st.resume_point(2, 2), Resume::Experts);
        assert_eq!(st.sections.len(), 1);
        // A corrupted outline after everything: nothing downstream survives.
        evs.push(ev(
            5,
            1,
            "phase",
            json!({"v": "fp", "phase": "outline", "payload": {"sections": "x"}}),
        ));
        let st = State::rebuild(&evs, "fp", 2, 2);
        assert_eq!(st.resume_point(2, 2), Resume::Outline);
        assert!(st.sections.is_empty());
        assert!(st.notes.iter().any(|n| n.contains("walked back")));
    }

    #[test]
    fn other_versions_and_stale_epochs_are_not_reused() {
        let evs = vec![
            ev(1, 1, "claimed", json!({})),
            ev(
                2,
                1,
                "phase",
                json!({"v": "old", "phase": "outline", "payload": outline(2)}),
            ),
        ];
        let st = State::rebuild(&evs, "fp", 2, 2);
        assert_eq!(st.resume_point(2, 2), Resume::Outline);
        let evs = vec![
            ev(1, 2, "claimed", json!({})),
            // epoch 1 after epoch 2's marker: a fenced-off owner
            ev(
                2,
                1,
                "phase",
                json!({"v": "fp", "phase": "outline", "payload": outline(2)}),
            ),
        ];
        assert!(State::rebuild(&evs, "fp", 2, 2).outline.is_none());
    }

    #[test]
    fn journal_rebuilds_the_in_flight_thread() {
        let j = |entry: Value| json!({"v": "fp", "expert": 1, "index": 0, "entry": entry});
        let evs = vec![
            ev(1, 1, "claimed", json!({})),
            ev(
                2,
                1,
                "phase",
                json!({"v": "fp", "phase": "outline", "payload": outline(1)}),
            ),
            ev(
                3,
                1,
                "phase",
                json!({"v": "fp", "phase": "perspectives", "payload": experts(2)}),
            ),
            ev(
                4,
                1,
                "journal",
                j(
                    json!({"op": "thread", "generation": 0, "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "p"}]}),
                ),
            ),
            ev(
                5,
                1,
                "journal",
                j(
                    json!({"op": "message", "generation": 0, "message": {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "search", "arguments": "{}"}}]}}),
                ),
            ),
            ev(
                6,
                1,
                "journal",
                j(
                    json!({"op": "message", "generation": 0, "message": {"role": "tool", "tool_call_id": "c1", "content": "r"}}),
                ),
            ),
        ];
        let st = State::rebuild(&evs, "fp", 2, 1);
        assert_eq!(st.journals[&(1, 0)].messages.len(), 4);
    }

    #[test]
    fn journal_is_read_only_from_the_oldest_section_still_in_flight() {
        let mut evs = vec![
            ev(1, 1, "claimed", json!({})),
            ev(
                2,
                1,
                "phase",
                json!({"v": "fp", "phase": "outline", "payload": outline(2)}),
            ),
        ];
        // No perspectives yet: no section can be in flight.
        assert_eq!(State::rebuild(&evs, "fp", 2, 2).journal_from(2, 2), None);
        evs.push(ev(
            3,
            1,
            "phase",
            json!({"v": "fp", "phase": "perspectives", "payload": experts(2)}),
        ));
        // Both experts start right after the perspectives checkpoint.
        assert_eq!(State::rebuild(&evs, "fp", 2, 2).journal_from(2, 2), Some(3));
        evs.push(ev(7, 1, "section", section(0, 0, "a")));
        evs.push(ev(9, 1, "section", section(1, 0, "b")));
        evs.push(ev(12, 1, "section", section(0, 1, "c")));
        // Expert 0 is done; expert 1 resumes after its last checkpoint.
        assert_eq!(State::rebuild(&evs, "fp", 2, 2).journal_from(2, 2), Some(9));
        evs.push(ev(15, 1, "section", section(1, 1, "d")));
        // Everything checkpointed: no journal needed.
        assert_eq!(State::rebuild(&evs, "fp", 2, 2).journal_from(2, 2), None);
    }
}
