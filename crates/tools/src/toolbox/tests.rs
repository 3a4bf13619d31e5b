//! Tests of the toolbox's configuration, its read backoff and its events.

use super::*;
use std::collections::HashMap;
use std::time::Duration;

#[test]
fn config_reads_the_environment() {
    let env: HashMap<&str, &str> = [
        ("LH_SEARCH_URL", "http://searx:8080/"),
        ("LH_FETCH_ALLOW", "sim, 10.0.0.0/8"),
        ("LH_PUBLISH_URL", "http://hooks/effects/"),
        ("LH_PUBLISH_DEDUPES", "false"),
        ("LH_FETCH_MAX_BYTES", "2048"),
        ("LH_FETCH_TIMEOUT", "3s"),
        ("LH_TOOL_FAULTS", "publish:timeout_after_commit:2"),
    ]
    .into_iter()
    .collect();
    let c = ToolboxConfig::from_lookup(|k| env.get(k).map(|v| v.to_string())).unwrap();
    assert_eq!(c.search.url, "http://searx:8080");
    assert_eq!(c.fetch.allow.hosts, vec!["sim".to_string()]);
    assert_eq!(c.fetch.allow.nets.len(), 1);
    assert_eq!(c.publish.url, "http://hooks/effects");
    assert!(!c.publish.dedupes_by_key);
    assert_eq!(c.fetch.max_bytes, 2048);
    assert_eq!(c.fetch.timeout, Duration::from_secs(3));
    let tb = Toolbox::builtin(&c, None, Arc::new(crate::NoEvents)).unwrap();
    assert_eq!(
        tb.faults().take("publish"),
        Some(FaultMode::TimeoutAfterCommit)
    );

    let d = ToolboxConfig::from_lookup(|_| None).unwrap();
    assert_eq!(d.search.url, DEFAULT_BASE_URL);
    assert_eq!(d.publish.url, format!("{DEFAULT_BASE_URL}/effects"));
    assert!(d.fetch.allow.is_empty());

    for (k, v) in [
        ("LH_TOOL_FAULTS", "x:nope"),
        ("LH_FETCH_ALLOW", "10.0.0.0/99"),
        ("LH_PUBLISH_DEDUPES", "maybe"),
        ("LH_FETCH_TIMEOUT", "15"),
        ("LH_FETCH_TIMEOUT", "0s"),
        ("LH_FETCH_MAX_BYTES", "1MB"),
        ("LH_SEARCH_URL", "searx:8080"),
        ("LH_PUBLISH_URL", "file:///tmp/effects"),
        ("LH_PUBLISH_URL", "http://"),
    ] {
        let e = ToolboxConfig::from_lookup(|q| (q == k).then(|| v.to_string())).unwrap_err();
        assert!(e.to_string().contains(k), "{k}={v}: {e}");
    }
}

#[test]
fn every_variable_read_is_listed() {
    let read = std::sync::Mutex::new(Vec::new());
    ToolboxConfig::from_lookup(|k| {
        read.lock().unwrap().push(k.to_string());
        None
    })
    .unwrap();
    let read = read.into_inner().unwrap();
    assert!(!read.is_empty());
    for k in read {
        assert!(
            ENV_VARS.iter().any(|(n, _)| *n == k),
            "{k} is not in ENV_VARS"
        );
    }
}

#[test]
fn backoff_is_capped_with_full_jitter() {
    let p = RetryPolicy {
        max_attempts: 10,
        base: Duration::from_millis(100),
        cap: Duration::from_millis(300),
        deadline: Duration::from_secs(1),
    };
    for attempt in 1..10 {
        assert!(p.delay(attempt) <= Duration::from_millis(300));
    }
    assert!(p.delay(1) <= Duration::from_millis(200));
}

#[test]
fn events_serialize_with_their_key() {
    let ev = ToolEvent {
        kind: ToolEventKind::Replayed,
        tool: "publish".into(),
        key: "k".into(),
        job_id: "j".into(),
        step_id: "s#1".into(),
        epoch: 2,
        at: "2026-11-30T00:00:00Z".into(),
        ok: Some(true),
        error: None,
        detail: None,
    };
    let v = serde_json::to_value(&ev).unwrap();
    assert_eq!(v["kind"], "replayed");
    assert_eq!(v["key"], "k");
    assert!(v.get("error").is_none());
}
