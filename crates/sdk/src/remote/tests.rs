//! Tests of remote kinds: their settings, the request signature, the bounded
//! toolbox cache and a recording op checked against the journal.

#[test]
fn a_kind_may_name_its_own_token_and_secret_variables() {
    let mut o = crate::Options::local("nats://127.0.0.1:4222", "lh");
    o.remote_kinds = vec![
        "a=http://a:1/;token=A_TOKEN;secret=A_SECRET".into(),
        "b=http://b:2/ ; secret=B_SECRET".into(),
        "c=http://c:3/".into(),
    ];
    let env = |k: &str| {
        match k {
            "A_TOKEN" => Some("ta"),
            "A_SECRET" => Some("value-of-a-secret"),
            "B_SECRET" => Some("sb"),
            "LH_REMOTE_TOKEN" => Some("t-default"),
            "LH_REMOTE_HMAC_SECRET" => Some("s-default"),
            "EMPTY" => Some(""),
            _ => None,
        }
        .map(String::from)
    };
    let kinds = RemoteConfig::from_options_with(&o, env).unwrap();
    let got: Vec<(&str, &str, Option<&str>, Option<&str>)> = kinds
        .iter()
        .map(|(n, c)| {
            (
                n.as_str(),
                c.url.as_str(),
                c.token.as_deref(),
                c.hmac_secret.as_deref(),
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            ("a", "http://a:1", Some("ta"), Some("value-of-a-secret")),
            ("b", "http://b:2", Some("t-default"), Some("sb")),
            ("c", "http://c:3", Some("t-default"), Some("s-default")),
        ]
    );
    for (spec, why) in [
        ("a=http://a:1/;secret=UNSET", "UNSET is not set"),
        ("a=http://a:1/;secret=EMPTY", "EMPTY is not set"),
        (
            "a=http://a:1/;password=A_SECRET",
            "unknown setting `password`",
        ),
        (
            "a=http://a:1/;secret=",
            "is not `token=VAR` or `secret=VAR`",
        ),
        ("a=http://a:1/;secret=$A_SECRET", "is not `token=VAR`"),
        ("a=http://a:1/;token", "is not `token=VAR`"),
    ] {
        o.remote_kinds = vec![spec.into()];
        let e = RemoteConfig::from_options_with(&o, env).unwrap_err();
        assert!(e.contains(why), "{spec}: {e}");
        assert!(!e.contains("value-of"), "no secret in the message: {e}");
    }
}

use super::*;

#[test]
fn hmac_matches_rfc_4231() {
    assert_eq!(
        hex::encode(hmac_sha256(b"Jefe", b"what do ya want for nothing?")),
        "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
    );
    let long = [0xaau8; 131];
    assert_eq!(
        hex::encode(hmac_sha256(
            &long,
            b"Test Using Larger Than Block-Size Key - Hash Key First"
        )),
        "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"
    );
}

#[test]
fn the_toolbox_cache_stays_bounded() {
    let mut m = BTreeMap::new();
    for i in 0..1000 {
        insert_bounded(&mut m, format!("tool-{i:04}"), i, 256);
    }
    assert_eq!(m.len(), 256);
    assert_eq!(m.get("tool-0999"), Some(&999), "the newest is kept");
}

fn rec(i: usize, id: &str, v: Value) -> Recorded {
    Recorded {
        index: i,
        id: id.into(),
        version: "1".into(),
        result: v,
    }
}

#[test]
fn a_recording_op_is_checked_against_the_journal() {
    let j = vec![rec(0, "a#0", json!(1))];
    let op = |i: u64, id: &str, r: Value| json!({"op": "step", "index": i, "id": id, "result": r});
    assert_eq!(
        position(&op(1, "b#0", json!(2)), &j).unwrap(),
        Some((1, "b#0".into()))
    );
    assert_eq!(position(&op(0, "a#0", json!(1)), &j).unwrap(), None);
    let e = position(&op(0, "a#0", json!(9)), &j).unwrap_err();
    assert!(
        matches!(&e, Error::Park { reason, message } if reason == "protocol_error" && message.contains("step_conflict")),
        "{e:?}"
    );
    let e = position(&op(0, "x#0", json!(1)), &j).unwrap_err();
    assert!(
        matches!(&e, Error::Park { reason, .. } if reason == "journal_mismatch"),
        "{e:?}"
    );
    assert!(matches!(
        position(&op(5, "b#0", json!(1)), &j),
        Err(Error::Retryable(_))
    ));
    assert!(matches!(
        position(&op(1, "nohash", json!(1)), &j),
        Err(Error::Retryable(_))
    ));
}

#[test]
fn a_sleep_op_names_exactly_one_time_or_is_a_protocol_error() {
    let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
    let due = |op: Value| sleep_due(&op).map(|f| f(now));
    assert_eq!(
        due(json!({"op": "sleep", "ms": 1500})).unwrap(),
        now + Duration::from_millis(1500)
    );
    assert_eq!(
        due(json!({"op": "sleep", "until": "2030-01-02T03:04:05Z"})).unwrap(),
        leasehold_core::time::parse_rfc3339("2030-01-02T03:04:05Z").unwrap()
    );
    for (bad, says) in [
        (json!({"op": "sleep"}), "exactly one of `ms` and `until`"),
        (
            json!({"op": "sleep", "ms": 1, "until": "2030-01-02T03:04:05Z"}),
            "exactly one",
        ),
        (
            json!({"op": "sleep", "ms": -5}),
            "whole number of milliseconds",
        ),
        (json!({"op": "sleep", "ms": "soon"}), "whole number"),
        (json!({"op": "sleep", "until": "tomorrow"}), "RFC 3339"),
    ] {
        let e = due(bad.clone()).unwrap_err().to_string();
        assert!(
            e.contains("protocol_error") && e.contains(says),
            "{bad}: {e}"
        );
    }
}
