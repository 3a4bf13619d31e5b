//! Side effects across worker crashes: the effects ledger and reconciliation.

use std::time::Duration;

use serde_json::json;

use crate::support::{spawn_sim, Env};

async fn sink_count(base: &str) -> u64 {
    let v: serde_json::Value = reqwest::get(format!("{base}/effects/count"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    v["count"].as_u64().unwrap()
}

#[tokio::test]
async fn worker_killed_between_in_flight_and_done_reconciles_to_one_effect() {
    let env = Env::new().await;
    // The sink records the first delivery, then hangs past the client's timeout.
    let (_sim, base) = spawn_sim(&[
        ("LH_SIM_EFFECTS_FAULTS", "commit_then_timeout:1".into()),
        ("LH_SIM_EFFECTS_HANG", "30s".into()),
    ])
    .await;
    let tools = [
        ("LH_PUBLISH_URL", format!("{base}/effects")),
        ("LH_KINDS", "deliver".into()),
    ];
    let mut a = env.worker_proc(&[], &tools);
    let args = json!({"title": "report", "document": "hello, once"});
    env.submit("deliver", json!({"input": args}), "once").await;
    // Wait for the worst moment: the effect is committed at the destination
    // while the ledger still says in_flight (the worker is waiting on the reply).
    let key = leasehold_tools::idempotency_key("once", "deliver#0", "publish");
    let effects = env.conn.js.get_key_value("lh_effects").await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        let entry = effects.get(&key).await.unwrap();
        let in_flight = entry.is_some_and(|e| String::from_utf8_lossy(&e).contains("in_flight"));
        if in_flight && sink_count(&base).await == 1 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "never reached committed-but-in-flight"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    a.kill9();
    let _b = env.worker_proc(&[], &tools);
    let r = env
        .wait_status("once", "completed", Duration::from_secs(20))
        .await;
    assert_eq!(r.stale_reclaims, 1, "resumed by a reclaim after the kill");
    let out = serde_json::to_value(r.result.unwrap()).unwrap()["output"].clone();
    assert_eq!(
        out["outcome"], "reconciled",
        "the in-flight effect was found at the destination, not re-run: {out}"
    );
    assert_eq!(sink_count(&base).await, 1, "exactly one effect at the sink");
    let entry = effects.get(&key).await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(&entry).contains("\"done\""));
    let tool_events: Vec<_> = env
        .events_of("once")
        .await
        .into_iter()
        .filter(|e| e.r#type == "tool")
        .collect();
    assert!(
        tool_events
            .iter()
            .any(|e| e.data_map()["kind"] == "reconciled"),
        "{tool_events:#?}"
    );
}

#[tokio::test]
async fn an_unknowable_outcome_parks_the_job_with_its_reason() {
    let env = Env::new().await;
    // A destination that does not deduplicate: the first delivery hangs past
    // the client's timeout and the worker dies meanwhile. The lookup by key
    // finds nothing, but without deduplication a second delivery could still
    // duplicate one that is about to land: the outcome is unknowable.
    let (_sim, base) = spawn_sim(&[
        ("LH_SIM_EFFECTS_FAULTS", "timeout_before_commit:1".into()),
        ("LH_SIM_EFFECTS_HANG", "30s".into()),
    ])
    .await;
    let tools = [
        ("LH_PUBLISH_URL", format!("{base}/effects")),
        ("LH_PUBLISH_DEDUPES", "false".into()),
        ("LH_KINDS", "deliver".into()),
    ];
    let mut a = env.worker_proc(&[], &tools);
    let args = json!({"title": "t", "document": "maybe twice"});
    env.submit("deliver", json!({"input": args}), "unsure")
        .await;
    let key = leasehold_tools::idempotency_key("unsure", "deliver#0", "publish");
    let effects = env.conn.js.get_key_value("lh_effects").await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while effects.get(&key).await.unwrap().is_none() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "never reached in flight"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    a.kill9();
    let _b = env.worker_proc(&[], &tools);
    let r = env
        .wait_for("unsure", Duration::from_secs(20), |r| {
            r.status == "parked" || r.status == "completed"
        })
        .await;
    assert_eq!(r.status, "parked", "{r:?}");
    assert_eq!(r.parked_reason.as_deref(), Some("uncertain_effect"));
    let why = r.error.unwrap().message;
    assert!(
        why.contains(&key[..16])
            || why.to_lowercase().contains("uncertain")
            || why.contains("unknow"),
        "the uncertainty is recorded: {why}"
    );
    assert_eq!(
        sink_count(&base).await,
        0,
        "nothing was delivered a second time"
    );
}
