//! Tests of decoding and validating submissions: ids, lanes, run times,
//! every refusal and protobuf.

use super::*;

fn sub<'a>(kind: &'a str, payload: &'a [u8]) -> Submission<'a> {
    Submission {
        kind,
        payload,
        msg_id: None,
        content_type: None,
        stream_seq: 7,
        received_at: at(0),
    }
}

fn at(s: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000 + s)
}

fn due(payload: &str) -> Result<Option<String>, String> {
    decode(sub("echo", payload.as_bytes()), &Kinds::default(), 4096)
        .map(|a| {
            assert_eq!(
                a.spec.delay, None,
                "the accepted spec names the due time alone"
            );
            a.spec.run_at
        })
        .map_err(|r| r.error.to_string())
}

#[test]
fn tenant_and_priority_are_checked_and_must_match_the_subject() {
    use crate::lane::Lane;
    let k = Kinds::default();
    let bad = |p: &str| {
        decode(sub("echo", p.as_bytes()), &k, 4096)
            .unwrap_err()
            .error
            .to_string()
    };
    assert!(bad(r#"{"input":{},"tenant":"a b"}"#).starts_with("tenant:"));
    assert!(bad(r#"{"input":{},"tenant":""}"#).starts_with("tenant:"));
    assert!(bad(r#"{"input":{},"tenant":7}"#).contains("tenant"));
    assert!(bad(r#"{"input":{},"priority":0}"#).contains("1..=5"));
    assert!(bad(r#"{"input":{},"priority":"high"}"#).contains("priority"));
    let mut a = decode(
        sub("echo", br#"{"input":{},"tenant":"acme","priority":2}"#),
        &k,
        4096,
    )
    .unwrap()
    .spec;
    let hint = |l: &Lane| format!("lh.submit.echo.{}.{}", l.tenant, l.priority);
    let e = check_lane(&mut a.clone(), &Lane::default(), hint).unwrap_err();
    assert_eq!(e.code(), "wrong_lane");
    assert!(e.to_string().contains("lh.submit.echo.acme.2"), "{e}");
    let acme = Lane::from_tokens("acme", "2").unwrap();
    check_lane(&mut a, &acme, hint).unwrap();
    // A spec that names nothing takes its subject's lane.
    let mut plain = decode(sub("echo", br#"{"input":{}}"#), &k, 4096)
        .unwrap()
        .spec;
    check_lane(&mut plain, &acme, hint).unwrap();
    assert_eq!(
        (plain.tenant.as_deref(), plain.priority),
        (Some("acme"), Some(2))
    );
}

#[test]
fn a_run_time_is_resolved_from_run_at_or_delay_after_the_submission() {
    assert_eq!(due(r#"{"input":{}}"#), Ok(None));
    assert_eq!(
        due(r#"{"input":{},"delay":"90s"}"#),
        Ok(Some(rfc3339(at(90))))
    );
    assert_eq!(
        due(r#"{"input":{},"delay":"2h"}"#),
        Ok(Some(rfc3339(at(7200))))
    );
    let t = rfc3339(at(3600));
    assert_eq!(
        due(&format!(r#"{{"input":{{}},"run_at":"{t}"}}"#)),
        Ok(Some(t))
    );
    // A slightly past time is tolerated (it runs at once).
    let t = rfc3339(at(0) - Duration::from_secs(299));
    assert_eq!(
        due(&format!(r#"{{"input":{{}},"run_at":"{t}"}}"#)),
        Ok(Some(t))
    );
}

#[test]
fn bad_run_times_are_refused_with_the_field_and_the_reason() {
    let e = due(r#"{"input":{},"run_at":"tomorrow"}"#).unwrap_err();
    assert!(
        e.starts_with("run_at: \"tomorrow\" is not an RFC 3339"),
        "{e}"
    );
    let e = due(r#"{"input":{},"delay":"soon"}"#).unwrap_err();
    assert!(e.starts_with("delay: invalid duration"), "{e}");
    let e = due(r#"{"input":{},"delay":"90"}"#).unwrap_err();
    assert!(e.contains("no unit"), "{e}");
    let t = rfc3339(at(600));
    let e = due(&format!(r#"{{"input":{{}},"run_at":"{t}","delay":"1s"}}"#)).unwrap_err();
    assert_eq!(e, "run_at: give either run_at or delay, not both");
    let t = rfc3339(at(0) - Duration::from_secs(301));
    let e = due(&format!(r#"{{"input":{{}},"run_at":"{t}"}}"#)).unwrap_err();
    assert!(e.contains("5m 1s in the past"), "{e}");
    let e = due(r#"{"input":{},"delay":"367d"}"#).unwrap_err();
    assert!(e.contains("beyond the maximum delay of 366 days"), "{e}");
    let t = rfc3339(at(367 * 86_400));
    let e = due(&format!(r#"{{"input":{{}},"run_at":"{t}"}}"#)).unwrap_err();
    assert!(e.starts_with("run_at: ") && e.contains("366 days"), "{e}");
    assert!(due(r#"{"input":{},"delay":"366d"}"#).is_ok());
}

fn err(kind: &str, payload: &[u8]) -> Rejected {
    decode(sub(kind, payload), &Kinds::default(), 1024).unwrap_err()
}

#[test]
fn id_comes_from_header_then_spec_then_sequence() {
    let k = Kinds::default();
    let mut s = sub("echo", br#"{"id":"from-spec","input":{}}"#);
    assert_eq!(decode(s, &k, 1024).unwrap().id, "from-spec");
    s.msg_id = Some("from-header");
    assert_eq!(decode(s, &k, 1024).unwrap().id, "from-header");
    assert_eq!(
        decode(sub("echo", br#"{"input":{}}"#), &k, 1024)
            .unwrap()
            .id,
        "seq-7"
    );
}

#[test]
fn every_bad_submission_gets_a_precise_error() {
    assert!(matches!(
        err("echo", b"not json").error,
        SubmitError::NotJson(_)
    ));
    assert!(matches!(err("echo", b"").error, SubmitError::Empty));
    assert!(
        matches!(err("echo", b"[1,2]").error, SubmitError::WrongShape(m) if m.contains("an array"))
    );
    let e = err("sleep", br#"{"input":{"ms":"soon"}}"#).error;
    assert_eq!(
        e.to_string(),
        "input.ms: expected a non-negative integer, got \"soon\""
    );
    let e = err("echo", br#"{"input":{},"budget":{"max_steps":"x"}}"#).error;
    assert!(
        matches!(&e, SubmitError::Field { path, .. } if path == "budget.max_steps"),
        "{e}"
    );
    let e = err("echo", br#"{"input":{},"budget":{"max_steps":0}}"#).error;
    assert!(e.to_string().contains("out of range"), "{e}");
    let e = err("nope", br#"{"input":{}}"#).error;
    assert!(matches!(&e, SubmitError::UnknownKind { .. }) && e.to_string().contains("echo"));
    assert!(matches!(
        err("echo", &[b'{', 0xff, b'}']).error,
        SubmitError::NotUtf8 { offset: 1 }
    ));
    assert!(matches!(
        err("echo", &[b' '; 2000]).error,
        SubmitError::TooLarge { size: 2000, .. }
    ));
    let e = err("echo", br#"{"inptu":{}}"#).error;
    assert!(e.to_string().contains("unknown field"), "{e}");
    let e = err("echo", br#"{"budget":{}}"#).error;
    assert_eq!(
        e.to_string(),
        "input: required: a JSON object with the job's input"
    );
    let e = err("research", br#"{"input":{"topic":"x","experts":99}}"#).error;
    assert!(e.to_string().contains("input.experts"), "{e}");
}

#[test]
fn rejected_keeps_the_id_when_known() {
    let mut s = sub("echo", b"garbage");
    s.msg_id = Some("job-1");
    assert_eq!(
        decode(s, &Kinds::default(), 1024)
            .unwrap_err()
            .id
            .as_deref(),
        Some("job-1")
    );
    assert_eq!(err("echo", b"garbage").id.as_deref(), Some("seq-7"));
    s.msg_id = Some("bad.id");
    assert_eq!(decode(s, &Kinds::default(), 1024).unwrap_err().id, None);
}

#[test]
fn protobuf_submissions_decode() {
    let spec = JobSpec {
        input: r#"{"ms":5}"#.into(),
        ..Default::default()
    };
    let bytes = spec.encode_to_vec();
    let mut s = sub("sleep", &bytes);
    s.content_type = Some("application/protobuf");
    let a = decode(s, &Kinds::default(), 1024).unwrap();
    assert_eq!(a.spec.input, r#"{"ms":5}"#);
    let mut s = sub("sleep", b"\xff\xff\xff");
    s.content_type = Some("application/protobuf");
    assert!(matches!(
        decode(s, &Kinds::default(), 1024).unwrap_err().error,
        SubmitError::Protobuf(_)
    ));
}
