//! Tests of which answer a park takes.

use super::shared::{answer_of, signal_answer, waited_until};
use super::*;
use serde_json::json;

fn m(v: Value) -> serde_json::Map<String, Value> {
    v.as_object().unwrap().clone()
}

fn answer(step: &str, parked_seq: u64, answer: Value, seq: u64) -> Signal {
    Signal {
        name: "lh-answer".into(),
        data: json!({"step": step, "parked_seq": parked_seq, "answer": answer}),
        seq,
        sent_at: String::new(),
        sender: Some("ana via cli".into()),
    }
}

#[test]
fn an_answer_signal_is_taken_only_by_the_park_it_answers_and_the_last_one_counts() {
    let sent = [
        answer("park#0", 10, json!({"ok": 1}), 1),
        answer("park#1", 12, json!({"ok": 2}), 2),
        answer("park#0", 10, json!({"ok": 3}), 3),
    ];
    assert_eq!(signal_answer("park#0", 10, &sent), Some(json!({"ok": 3})));
    assert_eq!(signal_answer("park#1", 12, &sent), Some(json!({"ok": 2})));
    // The same step parked again (a later `parked` event): the answers
    // to its earlier park are not this one's.
    assert_eq!(signal_answer("park#0", 14, &sent), None);
    assert_eq!(signal_answer("park#2", 12, &sent), None);
}

#[test]
fn an_answer_is_taken_only_by_the_park_it_names_after_that_park() {
    let p0 = Some((10, m(json!({"reason": "approve-1", "step": "park#0"}))));
    let a0 = Some((11, m(json!({"answer": {"ok": 1}, "step": "park#0"}))));
    assert_eq!(
        answer_of("park#0", p0.clone(), a0.clone()),
        Some(json!({"ok": 1}))
    );
    // The second park of the run: the first answer is not its own.
    assert_eq!(answer_of("park#1", p0.clone(), a0.clone()), None);
    // Parked again at park#1 after the first answer: still not its own.
    let p1 = Some((12, m(json!({"reason": "approve-2", "step": "park#1"}))));
    assert_eq!(answer_of("park#1", p1.clone(), a0), None);
    // An answer older than its park is never used.
    let old = Some((9, m(json!({"answer": 1, "step": "park#0"}))));
    assert_eq!(answer_of("park#0", p0.clone(), old), None);
    // An answer naming no step (written before answers named steps,
    // or for a park no step asked) is nobody's.
    let bare = Some((13, m(json!({"answer": 1}))));
    assert_eq!(answer_of("park#1", p1.clone(), bare), None);
    let a1 = Some((13, m(json!({"answer": 2, "step": "park#1"}))));
    assert_eq!(answer_of("park#1", p1, a1), Some(json!(2)));
    assert_eq!(answer_of("park#0", None, None), None);
}

#[test]
fn a_sleep_takes_the_time_only_its_own_wait_named() {
    let at = "2026-12-06T10:00:00Z";
    let rec = JobRecord {
        waiting_until: Some(at.into()),
        waiting_step: Some("sleep#0".into()),
        ..Default::default()
    };
    assert_eq!(
        waited_until(&rec, "sleep#0"),
        leasehold_core::time::parse_rfc3339(at)
    );
    // The next sleep of the run starts its own wait.
    assert_eq!(waited_until(&rec, "sleep#1"), None);
    // A record that names no time is no wait.
    let bare = JobRecord {
        waiting_step: Some("sleep#0".into()),
        ..Default::default()
    };
    assert_eq!(waited_until(&bare, "sleep#0"), None);
}
