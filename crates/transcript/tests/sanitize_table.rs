//! The sanitation table: each transcript with the exact prefix a warm retry
//! keeps, plus a property test that repair always yields a sound prefix.

use leasehold_transcript::{
    check, compact, sanitize, CompactionPolicy, DropReason, Message, Thread, ToolCall, Verdict,
};
use proptest::prelude::*;

const P: &str = "Write the reliability section.";

fn sys() -> Message {
    Message::system("You are a research agent.")
}
fn user(s: &str) -> Message {
    Message::user(s)
}
fn call(id: &str, name: &str) -> ToolCall {
    ToolCall::new(id, name, format!("{{\"q\":\"{id}\"}}"))
}
fn calls(ids: &[&str]) -> Message {
    Message::assistant_calls(ids.iter().map(|id| call(id, "search")).collect())
}
fn res(id: &str) -> Message {
    Message::tool(id, format!("result of {id}"))
}
fn partial(text: &str) -> Message {
    Message::Assistant {
        content: Some(text.into()),
        tool_calls: vec![],
        refusal: None,
        partial: true,
    }
}

/// (name, transcript, expected kept length, expected verdict)
fn table() -> Vec<(&'static str, Vec<Message>, usize, Verdict)> {
    vec![
        // The seed's example: one complete search exchange, then a scrape call
        // whose result was never recorded.
        (
            "seed example",
            vec![
                sys(),
                user(P),
                Message::assistant_calls(vec![ToolCall::new(
                    "c1",
                    "search",
                    r#"{"query":"worker leases"}"#,
                )]),
                Message::tool("c1", "search results"),
                Message::assistant_calls(vec![ToolCall::new(
                    "c2",
                    "scrape",
                    r#"{"url":"https://example.com/article"}"#,
                )]),
            ],
            4,
            Verdict::Warm,
        ),
        ("prompt only", vec![sys(), user(P)], 2, Verdict::Warm),
        (
            "one complete group",
            vec![sys(), user(P), calls(&["a"]), res("a")],
            4,
            Verdict::Warm,
        ),
        (
            "three calls two results drops the whole group",
            vec![
                sys(),
                user(P),
                calls(&["a"]),
                res("a"),
                calls(&["b", "c", "d"]),
                res("b"),
                res("c"),
            ],
            4,
            Verdict::Warm,
        ),
        (
            "parallel group complete, results out of order",
            vec![sys(), user(P), calls(&["a", "b"]), res("b"), res("a")],
            5,
            Verdict::Warm,
        ),
        (
            "half-recorded final answer dropped",
            vec![
                sys(),
                user(P),
                calls(&["a"]),
                res("a"),
                partial("The reliab"),
            ],
            4,
            Verdict::Warm,
        ),
        (
            "empty final answer dropped",
            vec![
                sys(),
                user(P),
                calls(&["a"]),
                res("a"),
                Message::Assistant {
                    content: Some("  ".into()),
                    tool_calls: vec![],
                    refusal: None,
                    partial: false,
                },
            ],
            4,
            Verdict::Warm,
        ),
        (
            "complete final answer is regenerated",
            vec![
                sys(),
                user(P),
                calls(&["a"]),
                res("a"),
                Message::assistant("Done."),
            ],
            4,
            Verdict::Warm,
        ),
        (
            "orphan tool result after prompt",
            vec![sys(), user(P), res("zz"), calls(&["a"]), res("a")],
            2,
            Verdict::Warm,
        ),
        (
            "stray result inside a group",
            vec![
                sys(),
                user(P),
                calls(&["a", "b"]),
                res("a"),
                res("x"),
                res("b"),
            ],
            2,
            Verdict::Warm,
        ),
        (
            "duplicate result after a complete group",
            vec![
                sys(),
                user(P),
                calls(&["a"]),
                res("a"),
                res("a"),
                calls(&["b"]),
                res("b"),
            ],
            4,
            Verdict::Warm,
        ),
        (
            "user message after the prompt stops the walk",
            vec![
                sys(),
                user(P),
                calls(&["a"]),
                res("a"),
                user("something else"),
                calls(&["b"]),
                res("b"),
            ],
            4,
            Verdict::Warm,
        ),
        (
            "latest exact prompt wins",
            vec![
                sys(),
                user(P),
                calls(&["a"]),
                res("a"),
                Message::assistant("old"),
                user(P),
                calls(&["b"]),
                res("b"),
                calls(&["c"]),
            ],
            8,
            Verdict::Warm,
        ),
        (
            "no section prompt",
            vec![sys(), user("another section"), calls(&["a"]), res("a")],
            0,
            Verdict::ColdOnly,
        ),
        (
            "unanswered call before the prompt",
            vec![sys(), calls(&["a"]), user(P), calls(&["b"]), res("b")],
            0,
            Verdict::ColdOnly,
        ),
        (
            "orphan result before the prompt",
            vec![sys(), res("q"), user(P)],
            0,
            Verdict::ColdOnly,
        ),
        (
            "partial tool-call proposal dropped",
            vec![
                sys(),
                user(P),
                calls(&["a"]),
                res("a"),
                Message::Assistant {
                    content: None,
                    tool_calls: vec![call("b", "fetch")],
                    refusal: None,
                    partial: true,
                },
            ],
            4,
            Verdict::Warm,
        ),
        (
            "reused call id is unexpected",
            vec![
                sys(),
                user(P),
                calls(&["a"]),
                res("a"),
                calls(&["a"]),
                res("a"),
            ],
            4,
            Verdict::Warm,
        ),
        (
            "refusal dropped",
            vec![
                sys(),
                user(P),
                Message::Assistant {
                    content: None,
                    tool_calls: vec![],
                    refusal: Some("I can't".into()),
                    partial: false,
                },
            ],
            2,
            Verdict::Warm,
        ),
        (
            "earlier complete sections kept before the prompt",
            vec![
                sys(),
                user("s1"),
                calls(&["a"]),
                res("a"),
                Message::assistant("s1 text"),
                user(P),
                calls(&["b"]),
                res("b"),
                calls(&["c", "d"]),
                res("d"),
            ],
            8,
            Verdict::Warm,
        ),
    ]
}

#[test]
fn sanitation_table_keeps_exact_prefix() {
    let t = table();
    assert!(t.len() >= 15);
    for (name, input, kept, verdict) in t {
        let r = sanitize(&input, P);
        assert_eq!(
            r.report.verdict,
            verdict,
            "{name}: verdict\n{}",
            r.report.human()
        );
        assert_eq!(
            r.messages,
            input[..kept].to_vec(),
            "{name}: prefix\n{}",
            r.report.human()
        );
        assert_eq!(r.report.kept, kept, "{name}");
        assert_eq!(r.report.entries.len(), input.len(), "{name}");
        assert!(check(&r.messages).is_ok(), "{name}");
    }
}

#[test]
fn incomplete_group_reasons_are_reported() {
    let input = vec![
        sys(),
        user(P),
        calls(&["a"]),
        res("a"),
        calls(&["b", "c", "d"]),
        res("b"),
        res("c"),
    ];
    let r = sanitize(&input, P);
    let reasons: Vec<_> = r.report.entries.iter().map(|e| e.reason.clone()).collect();
    assert_eq!(
        reasons[4],
        Some(DropReason::IncompleteToolGroup {
            expected: 3,
            answered: 2
        })
    );
    assert_eq!(reasons[5], Some(DropReason::PartOfIncompleteGroup));
    assert_eq!(reasons[6], Some(DropReason::PartOfIncompleteGroup));
    assert_eq!(r.report.tool_groups_kept, 1);
}

#[test]
fn compaction_only_on_valid_and_reinspected() {
    let big = "x".repeat(5000);
    let mut msgs = vec![sys(), user(P)];
    for id in ["a", "b", "c"] {
        msgs.push(calls(&[id]));
        msgs.push(Message::tool(id, big.clone()));
    }
    let policy = CompactionPolicy {
        max_chars: 7000,
        keep_recent_groups: 1,
        truncate_to: 100,
    };
    let (out, rep) = compact(&msgs, &policy).unwrap();
    assert!(check(&out).is_ok());
    assert_eq!(rep.truncated, 2);
    assert!(rep.after_chars <= 7000);
    // Unsound input is refused.
    let mut broken = msgs.clone();
    broken.push(calls(&["z"]));
    assert!(compact(&broken, &policy).is_err());
    // A target that cannot be met is an error, not a broken transcript.
    let tiny = CompactionPolicy {
        max_chars: 10,
        ..policy
    };
    assert!(compact(&msgs, &tiny).is_err());
}

#[test]
fn cold_rebuild_starts_next_generation() {
    let t = Thread::first("sys", "", P);
    let t2 = t.cold_rebuild("sys", "Section 1: done.", P);
    assert_eq!(t2.generation, 1);
    assert_eq!(t2.messages.len(), 2);
    assert_eq!(t2.messages[1], Message::user(P));
    assert!(
        matches!(&t2.messages[0], Message::System { content } if content.contains("Section 1: done."))
    );
    assert_eq!(sanitize(&t2.messages, P).report.verdict, Verdict::Warm);
}

fn arb_message() -> impl Strategy<Value = Message> {
    let id = prop::sample::select(vec!["a", "b", "c", "d", "e"]);
    prop_oneof![
        2 => Just(user(P)),
        1 => Just(user("other")),
        1 => Just(sys()),
        3 => prop::collection::vec(id.clone(), 1..4).prop_map(|ids| calls(&ids)),
        4 => id.prop_map(res),
        1 => Just(Message::assistant("answer")),
        1 => Just(partial("half")),
    ]
}

proptest! {
    #[test]
    fn repair_is_a_sound_prefix(msgs in prop::collection::vec(arb_message(), 0..24)) {
        let r = sanitize(&msgs, P);
        prop_assert!(r.messages.len() <= msgs.len());
        prop_assert_eq!(&r.messages[..], &msgs[..r.messages.len()]);
        prop_assert!(check(&r.messages).is_ok());
        // No orphans either way, checked independently of `check`.
        let call_ids: Vec<&str> = r.messages.iter().flat_map(|m| m.tool_calls().iter().map(|c| c.id.as_str())).collect();
        let result_ids: Vec<&str> = r.messages.iter().filter_map(|m| match m { Message::Tool { tool_call_id, .. } => Some(tool_call_id.as_str()), _ => None }).collect();
        for id in &call_ids { prop_assert!(result_ids.contains(id)); }
        for id in &result_ids { prop_assert!(call_ids.contains(id)); }
        if r.report.verdict == Verdict::Warm {
            prop_assert!(r.messages.iter().any(|m| *m == user(P)));
            // Ends valid: nothing partial and no trailing assistant text.
            let trailing_text = matches!(r.messages.last(), Some(Message::Assistant { tool_calls, .. }) if tool_calls.is_empty());
            prop_assert!(!trailing_text);
        } else {
            prop_assert!(r.messages.is_empty());
        }
    }
}
