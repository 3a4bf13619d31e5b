//! Side effects across worker crashes: the effects ledger and reconciliation.

use std::time::Duration;

use serde_json::json;

use leasehold_testkit::{spawn_sim, Fleet};

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
    let env = Fleet::start().await;
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
    let key = deliver_key(&env, "once").await;
    let effects = env.conn.js.get_key_value("lh_effects").await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        let entry = effects
            .get(leasehold_testkit::doors::ledger::ledger_key("once", &key))
            .await
            .unwrap();
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
    let entry = effects
        .get(leasehold_testkit::doors::ledger::ledger_key("once", &key))
        .await
        .unwrap()
        .unwrap();
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
    let env = Fleet::start().await;
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
    let key = deliver_key(&env, "unsure").await;
    let effects = env.conn.js.get_key_value("lh_effects").await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while effects
        .get(leasehold_testkit::doors::ledger::ledger_key("unsure", &key))
        .await
        .unwrap()
        .is_none()
    {
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

/// Waits until some entry of the effects ledger is `in_flight`.
async fn wait_in_flight(effects: &async_nats::jetstream::kv::Store, within: Duration) {
    use futures::StreamExt;
    let mut w = effects.watch_all().await.unwrap();
    let found = tokio::time::timeout(within, async {
        while let Some(e) = w.next().await {
            if String::from_utf8_lossy(&e.unwrap().value).contains("in_flight") {
                return;
            }
        }
    })
    .await;
    assert!(found.is_ok(), "no effect went in flight");
}

#[tokio::test]
async fn a_parked_effect_outlives_the_ledger_retention_and_reconciles_on_resume() {
    // The ledger's retention is far shorter than the time the job stays
    // parked: the job's entries must outlive it all the same.
    let env = Fleet::with(leasehold_testkit::SetupOptions {
        ack_wait: leasehold_testkit::ACK_WAIT,
        effects_retention: Duration::from_secs(2),
        ..Default::default()
    })
    .await;
    // A destination that does not deduplicate, where the first delivery is
    // stuck on the way and lands late, after the next owner looked for it.
    let (sim, base) = spawn_sim(&[
        ("LH_SIM_EFFECTS_FAULTS", "commit_late:1".into()),
        ("LH_SIM_EFFECTS_HANG", "8s".into()),
        ("LH_SIM_EFFECTS_DEDUPE", "false".into()),
    ])
    .await;
    let tools = [
        ("LH_PUBLISH_URL", format!("{base}/effects")),
        ("LH_PUBLISH_DEDUPES", "false".into()),
        ("LH_KINDS", "deliver".into()),
    ];
    let effects = env.conn.js.get_key_value("lh_effects").await.unwrap();
    let mut a = env.worker_proc(&[], &tools);
    let args = json!({"title": "t", "document": "lands late"});
    env.submit("deliver", json!({"input": args}), "late").await;
    wait_in_flight(&effects, Duration::from_secs(15)).await;
    leasehold_testkit::wait_log(&sim, "commit_late: holding", Duration::from_secs(15)).await;
    a.kill9();
    // The next owner finds no record at a destination that cannot dedupe:
    // the outcome is uncertain and the job waits for a person.
    let _b = env.worker_proc(&[], &tools);
    let r = env
        .wait_for("late", Duration::from_secs(20), |r| {
            r.status == "parked" || r.status == "completed"
        })
        .await;
    assert_eq!(r.status, "parked", "{r:?}");
    assert_eq!(sink_count(&base).await, 0, "looked before it landed");
    // The delivery lands while the job is parked ...
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while sink_count(&base).await == 0 {
        assert!(tokio::time::Instant::now() < deadline, "never landed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // ... and the ledger's retention passes: an entry written without a
    // job's protection (a plain put) is gone.
    effects.put("retention-probe", "x".into()).await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while effects.get("retention-probe").await.unwrap().is_some() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "max_age never expired the probe"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (code, out, err) = leasehold_testkit::cli(&env.url(), &["review", "resume", "late"]).await;
    assert_eq!(code, 0, "{out}{err}");
    let r = env
        .wait_for("late", Duration::from_secs(20), |r| {
            r.status == "completed" || r.status == "failed"
        })
        .await;
    assert_eq!(r.status, "completed", "{r:?}");
    let out = serde_json::to_value(r.result.unwrap()).unwrap()["output"].clone();
    assert_eq!(
        sink_count(&base).await,
        1,
        "the resume reconciled the late delivery instead of sending it again: {out}"
    );
    assert_eq!(out["outcome"], "reconciled", "{out}");
}

#[tokio::test]
async fn setup_upgrades_an_existing_ledger_to_entries_that_never_expire() {
    // A ledger bucket as an earlier `leasehold setup` made it: no
    // per-message TTLs, so `Nats-TTL: never` would be refused.
    let server = leasehold_harness::NatsServer::start();
    leasehold_harness::wait_for_jetstream(&server.url(), Duration::from_secs(10)).await;
    let conn = leasehold_testkit::doors::layout::NatsArgs::local(server.url(), "lh")
        .connect("test")
        .await
        .unwrap();
    conn.js
        .create_key_value(async_nats::jetstream::kv::Config {
            bucket: "lh_effects".into(),
            history: 1,
            max_age: Duration::from_secs(7 * 86_400),
            ..Default::default()
        })
        .await
        .unwrap();
    let refused = leasehold_testkit::doors::ledger::EffectsLedger::open(&conn.js, "lh_effects")
        .await
        .err()
        .expect("an old ledger bucket is refused");
    assert!(
        refused.to_string().contains("run `leasehold setup`"),
        "{refused}"
    );
    leasehold_testkit::doors::layout::ensure(&conn, &Default::default())
        .await
        .unwrap();
    let mut s = conn.js.get_stream("KV_lh_effects").await.unwrap();
    let cfg = s.info().await.unwrap().config.clone();
    assert!(cfg.allow_message_ttl, "{cfg:?}");
    let ledger = leasehold_testkit::doors::ledger::EffectsLedger::open(&conn.js, "lh_effects")
        .await
        .unwrap();
    let tb = leasehold_testkit::doors::ledger::Toolbox::builtin(
        &leasehold_testkit::doors::ledger::ToolboxConfig::with_base_url("http://127.0.0.1:9"),
        Some(ledger),
        std::sync::Arc::new(leasehold_testkit::doors::ledger::NoEvents),
    )
    .unwrap();
    // A write is recorded (and, its destination unreachable, withdrawn):
    // the ledger accepts its never-expiring entries.
    let err = tb
        .call(
            &leasehold_testkit::doors::ledger::CallCtx::new("j", "publish#0", 1),
            "publish",
            &json!({"title": "t", "document": "d"}),
        )
        .await
        .unwrap_err();
    assert_eq!(err.class(), "unreachable", "{err}");
}

// Issue 18: a recorded cancel whose notice did not reach the owner (here
// written into the record directly, as a canceller's lost notice leaves
// it) did not stop a write effect whose ownership proof came after it:
// the proof succeeded and the effect ran. The worker is held at the
// ledger read that precedes the proof while the cancel lands.
// The fault proxy runs in this test's runtime: it needs threads of
// its own while the test body blocks (e.g. waiting on a process).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_recorded_before_a_write_effects_proof_stops_the_effect() {
    let env = Fleet::start().await;
    let (_sim, base) = spawn_sim(&[]).await;
    let proxy = leasehold_harness::FaultProxy::start(&env.url()).await;
    let tools = [
        ("LH_PUBLISH_URL", format!("{base}/effects")),
        ("LH_KINDS", "deliver".into()),
        ("NATS_URL", proxy.url()),
    ];
    let a = env.worker_proc(&[], &tools);
    leasehold_testkit::wait_log(&a, "worker starting", Duration::from_secs(10)).await;
    let hold = proxy.hold("$JS.API.DIRECT.GET.KV_lh_effects.>");
    let args = json!({"title": "t", "document": "never, once cancelled"});
    env.submit("deliver", json!({"input": args}), "cancel-first")
        .await;
    tokio::time::timeout(Duration::from_secs(15), hold.triggered())
        .await
        .expect("the worker reached the ledger read before its proof");
    env.jobs
        .transition("cancel-first", |r| {
            let mut n = r.clone();
            n.cancel_requested = true;
            Ok(Some(n))
        })
        .await
        .unwrap();
    hold.release();
    let r = env
        .wait_for("cancel-first", Duration::from_secs(20), |r| {
            matches!(r.status.as_str(), "cancelled" | "completed" | "failed")
        })
        .await;
    assert_eq!(r.status, "cancelled", "{r:?}");
    assert_eq!(sink_count(&base).await, 0, "the effect never ran");
}

/// The idempotency key of a `deliver` job's one write, from its record's
/// incarnation.
async fn deliver_key(env: &Fleet, id: &str) -> String {
    let r = env.wait_for(id, Duration::from_secs(15), |_| true).await;
    leasehold_testkit::doors::ledger::incarnation_key(id, &r.created_at, "deliver#0", "publish")
}
