//! A job's waterfall, as a pure model of its own events: one attempt per
//! `claimed` marker (its worker, its epoch, how it ended), and inside it
//! the phases, the sections per expert, the steps, the `model` calls
//! (tokens, duration, time to first token) and the tool calls; the waits
//! (queued, retry backoff, a provider's cooldown, parked until answered,
//! the owner's silence until a reclaim) on the same time axis.
//!
//! Built by [`Builder::push`], one event at a time in sequence order, so a
//! cache can keep a builder and feed it only the events that landed since
//! ([`Waterfall::from_events`] is the one-shot form). Nothing here reads
//! the store or draws: `waterfall_svg` draws.
//!
//! What a reclaim repeated: the decision that an epoch's claim supersedes
//! what the earlier epochs did after their last checkpoint is the job
//! page's [`Supersedes`] tracker's. When it says so, each unit of work
//! (a section, a phase, a step) the earlier attempt left without its
//! checkpoint hands on its model calls whose response never made it to the
//! journal (or whose tool calls were not all answered there: the repair
//! drops such a proposal) and its tool calls that started and never
//! finished; the new attempt's first calls in the same unit are marked as
//! repeating them. A call killed in flight leaves no `model` event (it is
//! written when the call ends), so its repeat cannot be seen.

use std::collections::{HashMap, VecDeque};

use leasehold_proto::JobEvent;
use serde_json::{Map, Value};

use crate::render::Supersedes;

/// What a bar is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    Phase,
    Section,
    Step,
    Model,
    Tool,
    Wait,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Phase => "phase",
            Kind::Section => "section",
            Kind::Step => "step",
            Kind::Model => "model",
            Kind::Tool => "tool",
            Kind::Wait => "wait",
        }
    }
}

/// One bar: times are seconds since the Unix epoch; an open bar (`end`
/// `None`) runs to the waterfall's end.
#[derive(Debug, Clone, PartialEq)]
pub struct Bar {
    pub kind: Kind,
    /// The row it is drawn in: `phases`, `expert 0`, `steps`, `tools`, `waits`.
    pub lane: String,
    /// A short name (`outline`, `#1 Title`, `sim-1`, `backoff`).
    pub label: String,
    pub start: f64,
    pub end: Option<f64>,
    /// The event it is built from (the one that ended it, for most).
    pub seq: u64,
    pub epoch: u64,
    /// What hovering says (plain text).
    pub detail: String,
    /// What it repeats, when a reclaim made it redo earlier work.
    pub repeated: Option<String>,
    /// Model calls: prompt and completion tokens.
    pub tokens: (u64, u64),
}

/// One attempt: from its claim to how it ended.
#[derive(Debug, Clone, PartialEq)]
pub struct Attempt {
    pub epoch: u64,
    pub worker: String,
    pub seq: u64,
    pub start: f64,
    pub end: Option<f64>,
    /// How it ended: `completed`, `failed`, `retry`, `handed back`,
    /// `reclaimed`, `claim lost`, `parked`, `cancelled`, or `running`.
    pub ended: String,
    pub bars: Vec<Bar>,
    /// Its last event's time (where a silent owner's attempt ends).
    last_at: f64,
}

/// A job's waterfall.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Waterfall {
    pub attempts: Vec<Attempt>,
    /// Waits between attempts (queued, backoff, parked, until a reclaim).
    pub waits: Vec<Bar>,
    /// The first and last event's times.
    pub first: Option<f64>,
    pub last: f64,
    pub last_seq: u64,
    /// Events seen, and those skipped (no readable time).
    pub events: u64,
    pub skipped: u64,
    /// The job reached a terminal event.
    pub finished: bool,
}

impl Waterfall {
    /// The waterfall of these events (in sequence order): the one-shot
    /// form of [`Builder`] (the route keeps a builder instead).
    #[cfg_attr(not(test), allow(dead_code))]
    pub fn from_events(events: &[(u64, JobEvent)]) -> Waterfall {
        let mut b = Builder::default();
        for (seq, ev) in events {
            b.push(*seq, ev);
        }
        b.waterfall().clone()
    }

    /// Bars of every attempt and the waits, counted (for the size bound).
    pub fn bar_count(&self) -> usize {
        self.waits.len()
            + self
                .attempts
                .iter()
                .map(|a| a.bars.len() + 1)
                .sum::<usize>()
    }
}

/// A unit of work of one attempt (a section, a phase, a step): its model
/// calls and how many of their responses the journal kept.
#[derive(Debug, Default, Clone)]
struct Unit {
    /// Bar indices of its model calls in the attempt.
    calls: Vec<usize>,
    /// Responses kept whole (an answer, or a proposal all of whose tool
    /// calls have results).
    kept: usize,
    /// Tool results the last proposal still waits for.
    awaiting: usize,
    /// Its checkpoint landed in this attempt.
    done: bool,
    /// When its first activity was (a section's bar starts there).
    first: Option<f64>,
}

/// Feeds a [`Waterfall`] one event at a time.
#[derive(Debug, Default)]
pub struct Builder {
    w: Waterfall,
    tracker: Supersedes,
    units: HashMap<String, Unit>,
    /// Tool calls of this attempt started and not finished: step id -> bar.
    tools: HashMap<String, usize>,
    /// What the current attempt may repeat: unit -> (seq, epoch) of calls.
    pending: HashMap<String, VecDeque<(u64, u64)>>,
    pending_tools: HashMap<String, (u64, u64)>,
    /// A job-level retry or park seen in the current attempt.
    hint: Option<String>,
    /// An open wait between attempts (backoff, parked): index in `waits`.
    open_wait: Option<usize>,
    /// Where the next phase or step bar starts.
    phase_from: f64,
    step_from: f64,
    submitted: Option<f64>,
}

fn s<'a>(d: &'a Map<String, Value>, k: &str) -> &'a str {
    d.get(k).and_then(Value::as_str).unwrap_or("")
}

fn u(d: &Map<String, Value>, k: &str) -> Option<u64> {
    d.get(k).and_then(Value::as_u64)
}

/// An event's time in seconds since the Unix epoch.
fn seconds(at: &str) -> Option<f64> {
    let t = leasehold_core::time::parse_rfc3339(at)?;
    Some(t.duration_since(std::time::UNIX_EPOCH).ok()?.as_secs_f64())
}

/// The unit of work an event belongs to, and the lane it is drawn in.
fn unit_of(d: &Map<String, Value>) -> Option<(String, String)> {
    if let Some(step) = d.get("step").and_then(Value::as_str) {
        return Some((format!("step {step}"), "steps".into()));
    }
    if let (Some(e), Some(i)) = (u(d, "expert"), u(d, "index")) {
        return Some((format!("expert {e} #{i}"), format!("expert {e}")));
    }
    let phase = s(d, "phase");
    if phase.is_empty() {
        return None;
    }
    Some(match u(d, "index") {
        Some(i) => (format!("{phase} #{i}"), "phases".into()),
        None => (phase.to_string(), "phases".into()),
    })
}

impl Builder {
    /// The waterfall so far.
    pub fn waterfall(&self) -> &Waterfall {
        &self.w
    }

    /// Roughly the bytes it holds (for the cache's bound).
    pub fn bytes(&self) -> usize {
        let bars = self.w.bar_count();
        bars * (std::mem::size_of::<Bar>() + 160) + self.units.len() * 128 + 1024
    }

    /// Takes one event (in sequence order; an older or repeated sequence
    /// is ignored, an event without a readable time is counted as skipped).
    pub fn push(&mut self, seq: u64, ev: &JobEvent) {
        if seq <= self.w.last_seq && self.w.events > 0 {
            return;
        }
        self.w.last_seq = seq;
        self.w.events += 1;
        let Some(at) = seconds(&ev.at) else {
            self.w.skipped += 1;
            return;
        };
        self.w.first = Some(self.w.first.map_or(at, |f| f.min(at)));
        self.w.last = self.w.last.max(at);
        let d = ev.data_map();
        if let Some(a) = self.w.attempts.last_mut() {
            if ev.epoch >= a.epoch && ev.r#type != "claimed" {
                a.last_at = a.last_at.max(at);
            }
        }
        match ev.r#type.as_str() {
            "submitted" => self.submitted = Some(at),
            "claimed" => self.claimed(seq, ev, at),
            "completed" | "failed" | "cancelled" | "dead" | "rejected" => self.terminal(ev, &d, at),
            "heartbeat_lost" => self.hint = Some("claim lost".into()),
            "parked" => self.parked(seq, ev, &d, at),
            "waiting" => self.waiting(seq, ev, &d, at),
            "answer" => self.close_wait(at),
            "retry" => self.retry(seq, ev, &d, at),
            "phase" => self.phase(seq, ev, &d, at),
            "section" => self.section(seq, ev, &d, at),
            "step" => self.step(seq, ev, &d, at),
            "model" => self.model(seq, ev, &d, at),
            "tool" => self.tool(seq, ev, &d, at),
            "journal" | "agent" => self.journal(&d, at),
            _ => {}
        }
    }

    fn bar(&mut self, bar: Bar) -> Option<usize> {
        let a = self.w.attempts.last_mut()?;
        a.bars.push(bar);
        Some(a.bars.len() - 1)
    }

    fn wait(&mut self, bar: Bar) -> usize {
        self.w.waits.push(bar);
        self.w.waits.len() - 1
    }

    fn close_wait(&mut self, at: f64) {
        if let Some(i) = self.open_wait.take() {
            if let Some(b) = self.w.waits.get_mut(i) {
                b.end = Some(at.max(b.start));
            }
        }
    }

    fn claimed(&mut self, seq: u64, ev: &JobEvent, at: f64) {
        let sup = self.tracker.see(ev);
        let reclaim = sup
            .as_ref()
            .is_some_and(|v| v["reason"].as_str() == Some("reclaim"));
        self.end_attempt(at, reclaim, ev.epoch);
        if self.w.attempts.is_empty() {
            if let Some(sub) = self.submitted.filter(|t| *t < at) {
                self.wait(wait_bar(
                    "queued",
                    sub,
                    Some(at),
                    seq,
                    ev.epoch,
                    "queued until the first claim",
                ));
            }
        }
        self.close_wait(at);
        // What the earlier attempt left unfinished, when the claim
        // supersedes it (the job page's decision): the units without their
        // checkpoint hand on their unkept calls and unfinished tools.
        let carried = if sup.is_some() {
            self.unfinished()
        } else {
            (HashMap::new(), HashMap::new())
        };
        (self.pending, self.pending_tools) = carried;
        self.units.clear();
        self.tools.clear();
        self.hint = None;
        self.phase_from = at;
        self.step_from = at;
        self.w.attempts.push(Attempt {
            epoch: ev.epoch,
            worker: ev.worker_id.clone().unwrap_or_else(|| "-".into()),
            seq,
            start: at,
            end: None,
            ended: "running".into(),
            bars: Vec::new(),
            last_at: at,
        });
    }

    /// Ends the open attempt at a new claim: how it ended, and the wait
    /// for a silent owner's claim to run out.
    fn end_attempt(&mut self, at: f64, reclaim: bool, epoch: u64) {
        let hint = self.hint.take();
        let Some(a) = self.w.attempts.last_mut() else {
            return;
        };
        if a.end.is_some() {
            return;
        }
        let last = a.last_at.min(at);
        a.end = Some(last);
        a.ended = match (hint, reclaim) {
            (Some(h), _) => h,
            (None, true) => "reclaimed".into(),
            (None, false) => "handed back".into(),
        };
        let (seq, from) = (a.seq, a.epoch);
        if reclaim && at > last && self.open_wait.is_none() {
            let why = format!(
                "epoch {from} went silent; its claim ran out and epoch {epoch} reclaimed the job"
            );
            self.wait(wait_bar("until reclaim", last, Some(at), seq, from, &why));
        }
    }

    /// The current attempt's unfinished work, as the next one may repeat it.
    #[allow(clippy::type_complexity)]
    fn unfinished(
        &mut self,
    ) -> (
        HashMap<String, VecDeque<(u64, u64)>>,
        HashMap<String, (u64, u64)>,
    ) {
        let mut pending = std::mem::take(&mut self.pending);
        let mut tools = std::mem::take(&mut self.pending_tools);
        let Some(a) = self.w.attempts.last() else {
            return (pending, tools);
        };
        for (key, unit) in &self.units {
            if unit.done {
                pending.remove(key);
                continue;
            }
            let unkept = unit.calls.len().saturating_sub(unit.kept);
            let q = pending.entry(key.clone()).or_default();
            for i in &unit.calls[unit.calls.len() - unkept..] {
                if let Some(b) = a.bars.get(*i) {
                    q.push_back((b.seq, b.epoch));
                }
            }
        }
        pending.retain(|_, q| !q.is_empty());
        for (step, i) in &self.tools {
            if let Some(b) = a.bars.get(*i) {
                tools.insert(step.clone(), (b.seq, b.epoch));
            }
        }
        (pending, tools)
    }

    fn terminal(&mut self, ev: &JobEvent, d: &Map<String, Value>, at: f64) {
        self.w.finished = true;
        self.close_wait(at);
        let Some(a) = self.w.attempts.last_mut() else {
            return;
        };
        if a.end.is_none() {
            a.end = Some(at);
        }
        a.ended = match (ev.r#type.as_str(), s(d, "class")) {
            ("failed", c) if !c.is_empty() => format!("failed ({c})"),
            (t, _) => t.to_string(),
        };
    }

    fn parked(&mut self, seq: u64, ev: &JobEvent, d: &Map<String, Value>, at: f64) {
        if let Some(a) = self.w.attempts.last_mut() {
            a.end.get_or_insert(at);
            a.ended = "parked".into();
        }
        let why = format!("parked: {} {}", s(d, "reason"), s(d, "message"));
        let i = self.wait(wait_bar("parked", at, None, seq, ev.epoch, why.trim()));
        self.open_wait = Some(i);
    }

    /// A durable timer or a wait for a signal: the attempt ended, and no
    /// worker holds the job until its time or its signal (the bar ends at
    /// the next claim).
    fn waiting(&mut self, seq: u64, ev: &JobEvent, d: &Map<String, Value>, at: f64) {
        if let Some(a) = self.w.attempts.last_mut() {
            a.end.get_or_insert(at);
            a.ended = "waiting".into();
        }
        let why = format!(
            "waiting {}, held by no worker",
            crate::render::waiting_for(d)
        );
        let until = seconds(s(d, "until"));
        let i = self.wait(wait_bar("waiting", at, until, seq, ev.epoch, &why));
        self.open_wait = Some(i);
    }

    fn retry(&mut self, seq: u64, ev: &JobEvent, d: &Map<String, Value>, at: f64) {
        let delay = u(d, "delay_ms").map(|ms| ms as f64 / 1000.0);
        let reason = s(d, "reason");
        match s(d, "scope") {
            "job" => {
                self.hint = Some("retry".into());
                if let Some(a) = self.w.attempts.last_mut() {
                    a.end.get_or_insert(at);
                    a.ended = "retry".into();
                }
                let why = format!("retry backoff until the next claim: {reason}");
                let i = self.wait(wait_bar(
                    "backoff",
                    at,
                    delay.map(|x| at + x),
                    seq,
                    ev.epoch,
                    &why,
                ));
                self.open_wait = Some(i);
            }
            _ => {
                let Some(delay) = delay.filter(|x| *x > 0.0) else {
                    return;
                };
                let label = if reason.starts_with("waiting for provider") {
                    "provider cooldown"
                } else {
                    "retry backoff"
                };
                let why = format!("{label} ({} scope): {reason}", s(d, "scope"));
                self.bar(Bar {
                    lane: "waits".into(),
                    ..wait_bar(label, at, Some(at + delay), seq, ev.epoch, &why)
                });
            }
        }
    }

    fn unit(&mut self, key: &str, at: f64) -> &mut Unit {
        let u = self.units.entry(key.to_string()).or_default();
        u.first.get_or_insert(at);
        u
    }

    fn phase(&mut self, seq: u64, ev: &JobEvent, d: &Map<String, Value>, at: f64) {
        let phase = s(d, "phase");
        let payload = d.get("payload").and_then(Value::as_object);
        let index = payload.and_then(|p| u(p, "index"));
        let key = match index {
            Some(i) if phase == "final" => format!("{phase} #{i}"),
            _ => phase.to_string(),
        };
        let start = self
            .units
            .get(&key)
            .and_then(|u| u.first)
            .unwrap_or(self.phase_from)
            .min(at);
        self.unit(&key, at).done = true;
        self.pending.remove(&key);
        self.phase_from = at;
        self.bar(Bar {
            kind: Kind::Phase,
            lane: "phases".into(),
            label: key.clone(),
            start,
            end: Some(at),
            seq,
            epoch: ev.epoch,
            detail: format!("phase {key} checkpointed"),
            repeated: None,
            tokens: (0, 0),
        });
    }

    fn section(&mut self, seq: u64, ev: &JobEvent, d: &Map<String, Value>, at: f64) {
        let p = d
            .get("payload")
            .and_then(Value::as_object)
            .cloned()
            .unwrap_or_default();
        let (Some(e), Some(i)) = (u(&p, "expert"), u(&p, "index")) else {
            return;
        };
        let key = format!("expert {e} #{i}");
        let start = self
            .units
            .get(&key)
            .and_then(|u| u.first)
            .unwrap_or(at)
            .min(at);
        self.unit(&key, at).done = true;
        self.pending.remove(&key);
        let title = s(&p, "title");
        self.bar(Bar {
            kind: Kind::Section,
            lane: format!("expert {e}"),
            label: format!("#{i} {title}"),
            start,
            end: Some(at),
            seq,
            epoch: ev.epoch,
            detail: format!("section expert {e} #{i} {title}: {}", s(&p, "status")),
            repeated: None,
            tokens: (0, 0),
        });
    }

    fn step(&mut self, seq: u64, ev: &JobEvent, d: &Map<String, Value>, at: f64) {
        let id = s(d, "id").to_string();
        let key = format!("step {id}");
        let start = self
            .units
            .get(&key)
            .and_then(|u| u.first)
            .unwrap_or(self.step_from)
            .min(at);
        self.unit(&key, at).done = true;
        self.pending.remove(&key);
        self.step_from = at;
        self.bar(Bar {
            kind: Kind::Step,
            lane: "steps".into(),
            label: id.clone(),
            start,
            end: Some(at),
            seq,
            epoch: ev.epoch,
            detail: format!("step {id} recorded (index {})", u(d, "i").unwrap_or(0)),
            repeated: None,
            tokens: (0, 0),
        });
    }

    fn model(&mut self, seq: u64, ev: &JobEvent, d: &Map<String, Value>, at: f64) {
        let dur = u(d, "duration_ms").unwrap_or(0) as f64 / 1000.0;
        let start = at - dur;
        let (key, lane) = unit_of(d).unwrap_or_else(|| ("calls".into(), "calls".into()));
        let tokens = (
            u(d, "tokens_in").unwrap_or(0),
            u(d, "tokens_out").unwrap_or(0),
        );
        let ttft = u(d, "first_token_ms")
            .map(|ms| {
                format!(
                    ", first token after {}",
                    crate::svg::duration(ms as f64 / 1000.0)
                )
            })
            .unwrap_or_default();
        let repeated = self
            .pending
            .get_mut(&key)
            .and_then(VecDeque::pop_front)
            .map(|(rs, re)| {
                format!(
                    "repeats model call #{rs} of epoch {re}, whose response the journal never kept"
                )
            });
        let model = s(d, "model");
        let detail = format!(
            "model {model} ({key}): {}{ttft}, {} in / {} out tokens, {}",
            crate::svg::duration(dur),
            tokens.0,
            tokens.1,
            s(d, "outcome"),
        );
        let i = self.bar(Bar {
            kind: Kind::Model,
            lane,
            label: model.to_string(),
            start,
            end: Some(at),
            seq,
            epoch: ev.epoch,
            detail,
            repeated,
            tokens,
        });
        if let Some(i) = i {
            self.unit(&key, start).calls.push(i);
        }
    }

    fn tool(&mut self, seq: u64, ev: &JobEvent, d: &Map<String, Value>, at: f64) {
        let step = s(d, "step_id").to_string();
        let tool = s(d, "tool").to_string();
        match s(d, "kind") {
            "started" => {
                let repeated = self.pending_tools.remove(&step).map(|(rs, re)| {
                    format!("repeats tool call #{rs} of epoch {re}, which never finished")
                });
                let i = self.bar(Bar {
                    kind: Kind::Tool,
                    lane: "tools".into(),
                    label: tool.clone(),
                    start: at,
                    end: None,
                    seq,
                    epoch: ev.epoch,
                    detail: format!("tool {tool} step {step}"),
                    repeated,
                    tokens: (0, 0),
                });
                if let Some(i) = i {
                    self.tools.insert(step, i);
                }
            }
            kind => {
                let ok = match d.get("ok").and_then(Value::as_bool) {
                    Some(true) => " ok",
                    Some(false) => " failed",
                    None => "",
                };
                let what = format!("tool {tool} step {step}: {kind}{ok} {}", s(d, "error"));
                match self.tools.remove(&step) {
                    Some(i) => {
                        if let Some(b) = self.w.attempts.last_mut().and_then(|a| a.bars.get_mut(i))
                        {
                            b.end = Some(at.max(b.start));
                            b.detail = what.trim().to_string();
                        }
                    }
                    None => {
                        self.bar(Bar {
                            kind: Kind::Tool,
                            lane: "tools".into(),
                            label: tool,
                            start: at,
                            end: Some(at),
                            seq,
                            epoch: ev.epoch,
                            detail: what.trim().to_string(),
                            repeated: None,
                            tokens: (0, 0),
                        });
                    }
                }
            }
        }
    }

    /// A journal entry (research's `journal`, an SDK agent's `agent`):
    /// counts the responses its unit kept whole.
    fn journal(&mut self, d: &Map<String, Value>, at: f64) {
        let Some((key, _)) = unit_of(d) else {
            return;
        };
        let entry = d.get("entry").and_then(Value::as_object);
        let msg = entry
            .and_then(|e| e.get("message"))
            .and_then(|m| m.get("message").or(Some(m)))
            .and_then(Value::as_object);
        let unit = self.unit(&key, at);
        let Some(m) = msg else {
            return;
        };
        match s(m, "role") {
            "assistant" if m.get("lh_partial").and_then(Value::as_bool) != Some(true) => {
                let calls = m
                    .get("tool_calls")
                    .and_then(Value::as_array)
                    .map_or(0, Vec::len);
                if calls == 0 {
                    unit.kept += 1;
                    unit.awaiting = 0;
                } else {
                    unit.awaiting = calls;
                }
            }
            "tool" if unit.awaiting > 0 => {
                unit.awaiting -= 1;
                if unit.awaiting == 0 {
                    unit.kept += 1;
                }
            }
            _ => {}
        }
    }
}

fn wait_bar(label: &str, start: f64, end: Option<f64>, seq: u64, epoch: u64, why: &str) -> Bar {
    Bar {
        kind: Kind::Wait,
        lane: "waits".into(),
        label: label.into(),
        start,
        end,
        seq,
        epoch,
        detail: why.to_string(),
        repeated: None,
        tokens: (0, 0),
    }
}

#[cfg(test)]
mod tests;
