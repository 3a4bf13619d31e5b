//! The journal of a job's durable steps: what earlier attempts recorded,
//! matched in order against what this attempt's code asks for.
//!
//! A step's id is its name and its occurrence (`fetch#0`, `fetch#1`, ...),
//! so loops get stable ids. The journal is the job's `step` events in
//! stream order (every epoch). The `i`-th step this attempt asks for must be
//! the `i`-th recorded one, or the code changed under a running job: the
//! attempt stops and parks the job with the two ids (Restate's journal
//! mismatch, Temporal's nondeterminism error), never guessing.

use std::collections::HashMap;

use serde_json::Value;

/// One recorded step (the data of a `step` event).
#[derive(Debug, Clone, PartialEq)]
pub struct Recorded {
    pub index: usize,
    pub id: String,
    /// The kind's version when it was recorded.
    pub version: String,
    pub result: Value,
}

impl Recorded {
    /// From a `step` event's data; `None` when it is not one.
    pub fn of(data: &serde_json::Map<String, Value>) -> Option<Recorded> {
        Some(Recorded {
            index: data.get("i")?.as_u64()? as usize,
            id: data.get("id")?.as_str()?.to_string(),
            version: data
                .get("v")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string(),
            result: data.get("result").cloned().unwrap_or(Value::Null),
        })
    }

    /// The event data this step is recorded as.
    pub fn data(&self) -> Value {
        serde_json::json!({"i": self.index, "id": self.id, "v": self.version, "result": self.result})
    }
}

/// What the journal says of the next step.
#[derive(Debug, Clone, PartialEq)]
pub enum Next {
    /// Recorded by an earlier attempt: its result, without running it.
    Replay(Value),
    /// Not recorded yet: run it, then record it at this index.
    Run { index: usize },
    /// The code asks for another step than the one recorded here.
    Mismatch(String),
}

/// The recorded steps and this attempt's position in them.
#[derive(Debug, Default)]
pub struct Journal {
    recorded: Vec<Recorded>,
    next: usize,
    occurrences: HashMap<String, usize>,
}

impl Journal {
    /// From recorded steps in stream order. An index recorded twice (an
    /// ack lost after the write landed) keeps its first record.
    pub fn new(steps: impl IntoIterator<Item = Recorded>) -> Journal {
        let mut recorded: Vec<Recorded> = Vec::new();
        for s in steps {
            if s.index == recorded.len() {
                recorded.push(s);
            }
        }
        Journal {
            recorded,
            next: 0,
            occurrences: HashMap::new(),
        }
    }

    /// The recorded steps, in order (index `i` at position `i`).
    pub fn into_recorded(self) -> Vec<Recorded> {
        self.recorded
    }

    /// The recorded steps, in order.
    pub fn steps(&self) -> &[Recorded] {
        &self.recorded
    }

    /// The id the next step named `name` gets: its name and occurrence.
    pub fn id_of(&mut self, name: &str) -> String {
        let n = self.occurrences.entry(name.to_string()).or_insert(0);
        let id = format!("{name}#{n}");
        *n += 1;
        id
    }

    /// What to do with the step `id`, asked for next.
    pub fn next(&mut self, id: &str, version: &str) -> Next {
        let i = self.next;
        match self.recorded.get(i) {
            Some(r) if r.id == id => {
                self.next += 1;
                Next::Replay(r.result.clone())
            }
            Some(r) => Next::Mismatch(format!(
                "journal mismatch at step {i}: the recorded run has `{}` (kind version {:?}), the code now asks for `{id}` (kind version {version:?}): the kind's code changed while the job ran; restore the code and `leasehold review resume` the job, or end it with `leasehold review fail`",
                r.id, r.version
            )),
            None => Next::Run { index: i },
        }
    }

    /// Records the step just run (after its event was written).
    pub fn recorded(&mut self, step: Recorded) {
        debug_assert_eq!(step.index, self.recorded.len());
        self.recorded.push(step);
        self.next = self.recorded.len();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn rec(i: usize, id: &str, v: Value) -> Recorded {
        Recorded {
            index: i,
            id: id.into(),
            version: "1".into(),
            result: v,
        }
    }

    #[test]
    fn ids_are_name_and_occurrence_so_loops_are_stable() {
        let mut j = Journal::default();
        assert_eq!(j.id_of("fetch"), "fetch#0");
        assert_eq!(j.id_of("parse"), "parse#0");
        assert_eq!(j.id_of("fetch"), "fetch#1");
    }

    #[test]
    fn recorded_steps_replay_in_order_then_new_ones_run() {
        let mut j = Journal::new([rec(0, "a#0", json!(1)), rec(1, "b#0", json!("x"))]);
        assert_eq!(j.next("a#0", "1"), Next::Replay(json!(1)));
        assert_eq!(j.next("b#0", "1"), Next::Replay(json!("x")));
        assert_eq!(j.next("c#0", "1"), Next::Run { index: 2 });
        j.recorded(rec(2, "c#0", json!(null)));
        assert_eq!(j.next("d#0", "1"), Next::Run { index: 3 });
    }

    #[test]
    fn another_order_is_a_mismatch_naming_both_steps() {
        let mut j = Journal::new([rec(0, "a#0", json!(1)), rec(1, "b#0", json!(2))]);
        assert_eq!(j.next("a#0", "1"), Next::Replay(json!(1)));
        let Next::Mismatch(m) = j.next("c#0", "2") else {
            panic!("expected a mismatch")
        };
        assert!(
            m.contains("step 1") && m.contains("`b#0`") && m.contains("`c#0`"),
            "{m}"
        );
    }

    #[test]
    fn a_step_recorded_twice_keeps_its_first_record() {
        let j = Journal::new([
            rec(0, "a#0", json!(1)),
            rec(0, "a#0", json!(9)),
            rec(1, "b#0", json!(2)),
        ]);
        assert_eq!(j.recorded.len(), 2);
        assert_eq!(j.recorded[0].result, json!(1));
        let data = j.recorded[1].data();
        assert_eq!(
            Recorded::of(data.as_object().unwrap()),
            Some(j.recorded[1].clone())
        );
    }
}
