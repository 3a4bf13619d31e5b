//! The pure waterfall model: event sequences in, attempts and bars out.

use leasehold_proto::JobEvent;
use serde_json::{json, Value};

use super::{Kind, Waterfall};
use crate::waterfall_svg::{aggregate, draw, View};

/// An event of epoch `epoch` by `worker` at `ms` milliseconds after a
/// fixed instant.
fn ev(epoch: u64, ty: &str, worker: &str, ms: u64, data: Value) -> JobEvent {
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_millis(1_790_000_000_000 + ms);
    JobEvent {
        job_id: "j".into(),
        epoch,
        at: leasehold_core::time::rfc3339(t),
        r#type: ty.into(),
        worker_id: (!worker.is_empty()).then(|| worker.to_string()),
        data: if data.is_null() {
            String::new()
        } else {
            data.to_string()
        },
    }
}

fn seqd(evs: Vec<JobEvent>) -> Vec<(u64, JobEvent)> {
    evs.into_iter()
        .enumerate()
        .map(|(i, e)| (i as u64 + 1, e))
        .collect()
}

fn claim(epoch: u64, w: &str, ms: u64, attempts: u64, stale: u64, reclaim: bool) -> JobEvent {
    ev(
        epoch,
        "claimed",
        w,
        ms,
        json!({"attempts": attempts, "stale_reclaims": stale, "reclaim": reclaim}),
    )
}

fn model(epoch: u64, w: &str, ms: u64, tags: Value, dur: u64, tool_calls: u64) -> JobEvent {
    let mut d = json!({"model": "sim-1", "tokens_in": 100, "tokens_out": 20, "duration_ms": dur,
        "first_token_ms": 30, "attempts": 1, "generation": 0,
        "outcome": if tool_calls > 0 { "tool_calls" } else { "ok" }, "tool_calls": tool_calls});
    if let (Some(o), Value::Object(t)) = (d.as_object_mut(), tags) {
        o.extend(t);
    }
    ev(epoch, "model", w, ms, d)
}

fn sec(e: u64, i: u64) -> Value {
    json!({"v": "fp", "expert": e, "index": i})
}

fn journal(epoch: u64, w: &str, ms: u64, e: u64, i: u64, message: Value) -> JobEvent {
    ev(
        epoch,
        "journal",
        w,
        ms,
        json!({"v": "fp", "expert": e, "index": i,
        "entry": {"op": "message", "generation": 0, "message": message}}),
    )
}

fn proposal() -> Value {
    json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "search", "arguments": "{}"}}]})
}

fn tool_result() -> Value {
    json!({"role": "tool", "tool_call_id": "c1", "content": "r"})
}

fn answer() -> Value {
    json!({"role": "assistant", "content": "text"})
}

fn section_done(epoch: u64, w: &str, ms: u64, e: u64, i: u64) -> JobEvent {
    ev(
        epoch,
        "section",
        w,
        ms,
        json!({"v": "fp", "payload": {"expert": e, "index": i, "title": "T", "status": "done"}}),
    )
}

/// The start of a research run by worker `w`: outline and perspectives.
fn start(w: &str) -> Vec<JobEvent> {
    vec![
        ev(0, "submitted", "", 0, json!({})),
        claim(1, w, 100, 0, 0, false),
        model(1, w, 400, json!({"v": "fp", "phase": "outline"}), 250, 0),
        ev(
            1,
            "phase",
            w,
            410,
            json!({"v": "fp", "phase": "outline", "payload": {"title": "x"}}),
        ),
        model(
            1,
            w,
            700,
            json!({"v": "fp", "phase": "perspectives"}),
            250,
            0,
        ),
        ev(
            1,
            "phase",
            w,
            710,
            json!({"v": "fp", "phase": "perspectives", "payload": {}}),
        ),
    ]
}

fn repeated(w: &Waterfall) -> Vec<(u64, u64, String)> {
    w.attempts
        .iter()
        .flat_map(|a| a.bars.iter())
        .filter_map(|b| b.repeated.as_ref().map(|r| (b.seq, b.epoch, r.clone())))
        .collect()
}

fn ended(w: &Waterfall) -> Vec<(u64, String, String)> {
    w.attempts
        .iter()
        .map(|a| (a.epoch, a.worker.clone(), a.ended.clone()))
        .collect()
}

#[test]
fn a_clean_run_is_one_attempt_with_its_phases_sections_and_calls() {
    let mut evs = start("w-a");
    evs.extend([
        model(1, "w-a", 1000, sec(0, 0), 200, 0),
        journal(1, "w-a", 1001, 0, 0, answer()),
        section_done(1, "w-a", 1010, 0, 0),
        ev(1, "completed", "w-a", 1100, json!({})),
    ]);
    let w = Waterfall::from_events(&seqd(evs));
    assert_eq!(ended(&w), vec![(1, "w-a".into(), "completed".into())]);
    let a = &w.attempts[0];
    let kinds: Vec<(Kind, &str)> = a.bars.iter().map(|b| (b.kind, b.lane.as_str())).collect();
    assert_eq!(
        kinds,
        vec![
            (Kind::Model, "phases"),
            (Kind::Phase, "phases"),
            (Kind::Model, "phases"),
            (Kind::Phase, "phases"),
            (Kind::Model, "expert 0"),
            (Kind::Section, "expert 0"),
        ]
    );
    // The outline phase starts where its model call did; the section too.
    assert!((a.bars[1].start - a.bars[0].start).abs() < 1e-6);
    assert!((a.bars[5].start - a.bars[4].start).abs() < 1e-6);
    assert!(
        a.bars[4].detail.contains("first token after 30 ms"),
        "{}",
        a.bars[4].detail
    );
    assert!(repeated(&w).is_empty());
    assert!(w.finished);
    // Queued from submission to the claim.
    assert_eq!(w.waits.len(), 1);
    assert_eq!(w.waits[0].label, "queued");
}

/// The table: a kill -9 at each point of a section, and what the
/// reclaiming worker's calls are marked as repeating.
#[test]
fn a_kill9_mid_section_marks_exactly_the_calls_the_reclaim_repeated() {
    // (what was durable when epoch 1 died, which of epoch 2's events are
    // model calls, how many of them repeat)
    type Case = (&'static str, Vec<JobEvent>, usize);
    let cases: Vec<Case> = vec![
        // The proposal was journaled, its tool never ran: the repair drops
        // it and asks again: one repeat.
        (
            "after the proposal",
            vec![
                model(1, "w-a", 1000, sec(0, 0), 200, 1),
                journal(1, "w-a", 1001, 0, 0, proposal()),
            ],
            1,
        ),
        // The proposal and its tool result were journaled: nothing repeats.
        (
            "after the tool result",
            vec![
                model(1, "w-a", 1000, sec(0, 0), 200, 1),
                journal(1, "w-a", 1001, 0, 0, proposal()),
                journal(1, "w-a", 1100, 0, 0, tool_result()),
            ],
            0,
        ),
        // The model event landed, the journal did not: the call repeats.
        (
            "before the journal",
            vec![model(1, "w-a", 1000, sec(0, 0), 200, 0)],
            1,
        ),
        // The section was checkpointed: nothing repeats.
        (
            "after the section",
            vec![
                model(1, "w-a", 1000, sec(0, 0), 200, 0),
                journal(1, "w-a", 1001, 0, 0, answer()),
                section_done(1, "w-a", 1010, 0, 0),
            ],
            0,
        ),
    ];
    for (name, died, want) in cases {
        let mut evs = start("w-a");
        evs.extend(died);
        evs.extend([
            claim(2, "w-b", 5000, 0, 1, true),
            model(2, "w-b", 5300, sec(0, 0), 200, 1),
            journal(2, "w-b", 5301, 0, 0, proposal()),
            journal(2, "w-b", 5400, 0, 0, tool_result()),
            model(2, "w-b", 5700, sec(0, 0), 200, 0),
            journal(2, "w-b", 5701, 0, 0, answer()),
            section_done(2, "w-b", 5710, 0, 0),
            ev(2, "completed", "w-b", 6000, json!({})),
        ]);
        let events = seqd(evs);
        let w = Waterfall::from_events(&events);
        assert_eq!(
            ended(&w),
            vec![
                (1, "w-a".into(), "reclaimed".into()),
                (2, "w-b".into(), "completed".into())
            ],
            "{name}"
        );
        let r = repeated(&w);
        assert_eq!(r.len(), want, "{name}: {r:?}");
        if want == 1 {
            // The first call of epoch 2 repeats epoch 1's call of the section.
            let first_b = events
                .iter()
                .find(|(_, e)| e.epoch == 2 && e.r#type == "model")
                .unwrap()
                .0;
            let first_a = events
                .iter()
                .find(|(_, e)| e.epoch == 1 && e.r#type == "model" && e.data.contains("expert"))
                .unwrap()
                .0;
            assert_eq!(r[0].0, first_b, "{name}");
            assert!(
                r[0].2.contains(&format!("#{first_a} of epoch 1")),
                "{name}: {}",
                r[0].2
            );
        }
        // The owner's silence until the reclaim is a wait.
        assert!(w.waits.iter().any(|b| b.label == "until reclaim"), "{name}");
    }
}

#[test]
fn a_job_retry_backs_off_until_the_next_claim_and_a_hand_back_is_named() {
    let evs = vec![
        claim(1, "w-a", 0, 0, 0, false),
        ev(
            1,
            "retry",
            "w-a",
            100,
            json!({"scope": "job", "reason": "boom", "delay_ms": 400}),
        ),
        claim(2, "w-b", 600, 1, 0, false),
        claim(3, "w-c", 900, 1, 0, false),
        ev(
            3,
            "parked",
            "w-c",
            1000,
            json!({"reason": "approve", "message": "ok?"}),
        ),
        ev(3, "answer", "", 3000, json!({"answer": true})),
        claim(4, "w-c", 3100, 1, 0, false),
        ev(
            4,
            "failed",
            "w-c",
            3200,
            json!({"class": "permanent", "message": "no"}),
        ),
    ];
    let w = Waterfall::from_events(&seqd(evs));
    assert_eq!(
        ended(&w),
        vec![
            (1, "w-a".into(), "retry".into()),
            (2, "w-b".into(), "handed back".into()),
            (3, "w-c".into(), "parked".into()),
            (4, "w-c".into(), "failed (permanent)".into()),
        ]
    );
    let waits: Vec<(&str, f64)> = w
        .waits
        .iter()
        .map(|b| (b.label.as_str(), b.end.unwrap() - b.start))
        .collect();
    assert_eq!(waits.len(), 2, "{waits:?}");
    assert_eq!(waits[0].0, "backoff");
    assert!(
        (waits[0].1 - 0.5).abs() < 1e-3,
        "backoff until the claim: {waits:?}"
    );
    assert_eq!(waits[1].0, "parked");
    assert!(
        (waits[1].1 - 2.0).abs() < 1e-3,
        "parked until the answer: {waits:?}"
    );
}

#[test]
fn cooldowns_steps_and_a_repeated_tool_call_are_drawn() {
    let evs = vec![
        claim(1, "w-a", 0, 0, 0, false),
        ev(
            1,
            "retry",
            "w-a",
            10,
            json!({"scope": "generation", "reason": "waiting for provider sim until later (cooldown: 429)", "delay_ms": 500}),
        ),
        model(1, "w-a", 900, json!({"step": "plan"}), 300, 0),
        ev(
            1,
            "step",
            "w-a",
            950,
            json!({"i": 0, "id": "plan", "v": 1, "result": 1}),
        ),
        ev(
            1,
            "tool",
            "w-a",
            1000,
            json!({"kind": "started", "tool": "publish", "step_id": "s-1", "key": "k"}),
        ),
        claim(2, "w-b", 3000, 0, 1, true),
        ev(
            2,
            "tool",
            "w-b",
            3100,
            json!({"kind": "started", "tool": "publish", "step_id": "s-1", "key": "k"}),
        ),
        ev(
            2,
            "tool",
            "w-b",
            3200,
            json!({"kind": "finished", "tool": "publish", "step_id": "s-1", "key": "k", "ok": true}),
        ),
    ];
    let w = Waterfall::from_events(&seqd(evs));
    let a = &w.attempts[0];
    assert!(a
        .bars
        .iter()
        .any(|b| b.label == "provider cooldown" && b.lane == "waits"));
    let step = a.bars.iter().find(|b| b.kind == Kind::Step).unwrap();
    assert_eq!(step.lane, "steps");
    // The step starts at its model call's start.
    assert!((step.end.unwrap() - step.start - 0.35).abs() < 1e-3);
    let r = repeated(&w);
    assert_eq!(r.len(), 1, "{r:?}");
    assert!(r[0].2.contains("tool call #5 of epoch 1"), "{r:?}");
    assert!(!w.finished);
    assert_eq!(w.attempts[1].ended, "running");
}

#[test]
fn garbage_is_skipped_never_a_panic() {
    let mut bad_time = ev(1, "model", "w", 0, json!({}));
    bad_time.at = "yesterday".into();
    let mut bad_data = ev(1, "section", "w", 10, Value::Null);
    bad_data.data = "{not json".into();
    let evs = vec![
        // Before any claim, of types it does not know, with wrong shapes.
        model(
            1,
            "w",
            5,
            json!({"expert": "zero", "index": -1, "duration_ms": "long"}),
            0,
            0,
        ),
        bad_time,
        bad_data,
        ev(1, "tool", "w", 20, json!({"kind": "finished"})),
        ev(1, "journal", "w", 30, json!({"entry": 7})),
        ev(1, "phase", "w", 40, json!({"phase": 3, "payload": "x"})),
        ev(1, "whatever", "w", 50, json!([1, 2])),
        claim(1, "w", 60, 0, 0, false),
        ev(
            1,
            "journal",
            "w",
            70,
            json!({"expert": 0, "index": 0, "entry": {"message": "text"}}),
        ),
        ev(1, "section", "w", 80, json!({"payload": {"expert": 0}})),
        ev(
            1,
            "retry",
            "w",
            90,
            json!({"scope": "warm", "delay_ms": -5}),
        ),
    ];
    let w = Waterfall::from_events(&seqd(evs));
    assert_eq!(w.events, 11);
    assert_eq!(w.skipped, 1);
    assert_eq!(w.attempts.len(), 1);
    let (svg, _) = draw(
        &w,
        &View {
            until: w.last,
            link: &|s| format!("#ev-{s}"),
        },
    );
    assert!(svg.starts_with("<svg"));
    // Sequences out of order or repeated are ignored.
    let mut b = super::Builder::default();
    b.push(5, &claim(1, "w", 0, 0, 0, false));
    b.push(5, &claim(2, "x", 10, 0, 1, true));
    b.push(3, &claim(2, "x", 10, 0, 1, true));
    assert_eq!(b.waterfall().attempts.len(), 1);
}

/// 10,000 events of one job: many tiny model calls in few sections.
pub fn big_job() -> Vec<(u64, JobEvent)> {
    let mut evs = start("w-a");
    let mut ms = 1000;
    for k in 0..4998u64 {
        let (e, i) = (k % 2, k / 1000);
        ms += 700;
        evs.push(model(1, "w-a", ms, sec(e, i), 300, 0));
        evs.push(journal(1, "w-a", ms + 1, e, i, answer()));
        if k % 1000 == 999 {
            evs.push(section_done(1, "w-a", ms + 2, e, i));
        }
    }
    evs.truncate(9999);
    evs.push(ev(1, "completed", "w-a", ms + 10, json!({})));
    seqd(evs)
}

#[test]
fn ten_thousand_events_draw_small_tiny_calls_aggregated() {
    let events = big_job();
    assert_eq!(events.len(), 10_000);
    let w = Waterfall::from_events(&events);
    let (svg, drawn) = draw(
        &w,
        &View {
            until: w.last,
            link: &|s| format!("#ev-{s}"),
        },
    );
    assert!(svg.len() < 300_000, "{} bytes", svg.len());
    assert!(drawn < 2000, "{drawn} rectangles");
    assert!(svg.contains("data-count="), "calls merged");
    // Incremental: the same model from two halves.
    let mut b = super::Builder::default();
    for (s, e) in &events[..5000] {
        b.push(*s, e);
    }
    for (s, e) in &events[5000..] {
        b.push(*s, e);
    }
    assert_eq!(b.waterfall(), &w);
}

#[test]
fn tiny_bars_merge_and_a_repeated_one_never_does() {
    let w = Waterfall::from_events(&seqd(vec![
        claim(1, "w", 0, 0, 0, false),
        model(1, "w", 10, sec(0, 0), 5, 0),
        model(1, "w", 20, sec(0, 0), 5, 0),
        model(1, "w", 30, sec(0, 0), 5, 0),
        model(1, "w", 100_000, sec(0, 0), 5, 0),
    ]));
    let mut bars: Vec<&super::Bar> = w.attempts[0].bars.iter().collect();
    let scale = 1000.0 / 100.0; // 1000 units for 100 s
    let g = aggregate(&bars, scale, w.last);
    assert_eq!(g.iter().map(|g| g.count).collect::<Vec<_>>(), vec![3, 1]);
    assert_eq!(g[0].tokens, (300, 60));
    let mut marked = bars[1].clone();
    marked.repeated = Some("x".into());
    bars[1] = &marked;
    let g = aggregate(&bars, scale, w.last);
    assert_eq!(
        g.iter().map(|g| g.count).collect::<Vec<_>>(),
        vec![1, 1, 1, 1]
    );
}

#[test]
fn the_picture_marks_the_repeat_names_both_workers_and_links_each_bar() {
    let mut evs = start("w-a");
    evs.extend([
        model(1, "w-a", 1000, sec(0, 0), 200, 1),
        journal(1, "w-a", 1001, 0, 0, proposal()),
        claim(2, "w-b", 5000, 0, 1, true),
        model(2, "w-b", 5300, sec(0, 0), 200, 0),
        ev(2, "completed", "w-b", 6000, json!({})),
    ]);
    let w = Waterfall::from_events(&seqd(evs));
    let (svg, _) = draw(
        &w,
        &View {
            until: w.last,
            link: &|s| format!("#ev-{s}"),
        },
    );
    assert_eq!(svg.matches("data-repeated=\"true\"").count(), 1, "{svg}");
    assert!(svg.contains("class=\"wf-model repeated\""));
    assert!(
        svg.contains("REPEATED: repeats model call #7 of epoch 1"),
        "{svg}"
    );
    assert!(svg.contains("data-worker=\"w-a\"") && svg.contains("data-worker=\"w-b\""));
    assert!(svg.contains("<a href=\"#ev-10\">"), "{svg}");
}

#[test]
fn a_durable_timer_ends_its_attempt_and_waits_in_its_own_bar_until_the_next_claim() {
    let t = |ms: u64| {
        leasehold_core::time::rfc3339(
            std::time::UNIX_EPOCH + std::time::Duration::from_millis(1_790_000_000_000 + ms),
        )
    };
    let w = Waterfall::from_events(&seqd(vec![
        claim(1, "w-a", 0, 0, 0, false),
        ev(
            1,
            "step",
            "w-a",
            10,
            json!({"i": 0, "id": "before#0", "result": 1}),
        ),
        ev(
            1,
            "waiting",
            "w-a",
            20,
            json!({"for": "time", "until": t(60_000), "step": "sleep#0"}),
        ),
        claim(2, "w-b", 60_050, 0, 0, false),
    ]));
    assert_eq!(w.attempts.len(), 2);
    assert_eq!(w.attempts[0].ended, "waiting");
    let bar = w
        .waits
        .iter()
        .find(|b| b.label == "waiting")
        .expect("a waiting bar");
    assert_eq!(bar.kind, Kind::Wait);
    assert!(bar.detail.contains("sleep#0") && bar.detail.contains("held by no worker"));
    // It ends at the claim that woke it, not at the time it asked for.
    let end = bar.end.unwrap();
    assert!(end - bar.start > 59.0, "{bar:?}");
}
