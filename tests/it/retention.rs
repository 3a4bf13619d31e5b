//! Retention: finished jobs go after their retention, everything of them in
//! a safe order; unfinished ones never; a job id can start again.

use std::time::Duration;

use serde_json::json;
use tokio_util::sync::CancellationToken;

use leasehold_testkit::Fleet;

async fn reaper(
    env: &Fleet,
    retention: &str,
    per_kind: &[&str],
) -> (leasehold_testkit::doors::reaper::Handle, CancellationToken) {
    let mut args = vec!["--retention", retention];
    let joined = per_kind.join(",");
    if !per_kind.is_empty() {
        args.extend(["--retention-kind", joined.as_str()]);
    }
    env.reaper_with(env.reaper_args(&args)).await
}

async fn gone(env: &Fleet, id: &str, within: Duration) {
    let deadline = tokio::time::Instant::now() + within;
    while env.jobs.get(id).await.unwrap().is_some() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "job {id} was not forgotten"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn finished_jobs_are_forgotten_after_their_retention_and_their_id_can_start_again() {
    // A dedupe window shorter than the retention, as in production (1 h
    // against 7 days): the id may come back once both passed.
    let env = Fleet::with(leasehold_testkit::SetupOptions {
        ack_wait: leasehold_testkit::ACK_WAIT,
        dedupe_window: Duration::from_secs(1),
        ..Default::default()
    })
    .await;
    let (w, stop) = env.worker().await;
    env.submit("echo", json!({"input": {"life": 1}}), "ret-1")
        .await;
    let done = env
        .wait_status("ret-1", "completed", Duration::from_secs(10))
        .await;
    // An artifact of the job, as the research workload leaves one.
    let store = env
        .conn
        .js
        .get_object_store(env.conn.layout.artifacts_bucket())
        .await
        .unwrap();
    store
        .put("ret-1/report.md", &mut "a report".as_bytes())
        .await
        .unwrap();
    let v = env.jobs.get("ret-1").await.unwrap().unwrap();
    let mut with_artifact = done.clone();
    with_artifact.result.as_mut().unwrap().artifact = Some("ret-1/report.md".into());
    env.jobs.update(&with_artifact, v.revision).await.unwrap();
    // A parked job is unfinished: kept whatever its age.
    let mut parked = leasehold_testkit::record::new_record(
        "kept-parked",
        "echo",
        Default::default(),
        0,
        std::time::SystemTime::now() - Duration::from_secs(3600),
    );
    parked.status = "parked".into();
    env.seed_record(&parked).await;
    assert!(!env.events_of("ret-1").await.is_empty());
    // A signal sent to it that no wait took (a plain publish: the CLI
    // refuses a finished job): it is the job's, and goes with it.
    leasehold_testkit::doors::signals::Signals::new(&env.conn)
        .send("ret-1", "late", &json!({}), None, None)
        .await
        .unwrap();

    let r = reaper(&env, "2s", &[]).await;
    gone(&env, "ret-1", Duration::from_secs(15)).await;
    // The record goes before the events (they are the pass's pointer to
    // the job): the pass is over once it counts the job forgotten.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while r
        .0
        .stats
        .forgotten
        .load(std::sync::atomic::Ordering::Relaxed)
        == 0
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the pass never counted the job"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        env.events_of("ret-1").await.is_empty(),
        "events go with the record"
    );
    assert!(
        store.get("ret-1/report.md").await.is_err(),
        "the artifact goes too"
    );
    let signals = env
        .conn
        .js
        .get_stream(env.conn.layout.signals_stream())
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .state
        .messages;
    assert_eq!(signals, 0, "its signals go too");
    assert!(
        env.jobs.get("kept-parked").await.unwrap().is_some(),
        "unfinished jobs stay"
    );
    assert!(
        r.0.stats
            .forgotten
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 1
    );

    // The id starts a new life: nothing of the old one is there.
    env.ticket("echo", json!({"input": {"life": 2}}), "ret-1")
        .await;
    let again = env
        .wait_status("ret-1", "completed", Duration::from_secs(10))
        .await;
    assert_eq!(again.epoch, 1);
    assert_eq!(again.result.unwrap().output, json!({"life": 2}).to_string());
    assert!(env.events_of("ret-1").await.iter().all(|e| e.epoch <= 1));
    stop.cancel();
    w.wait().await.unwrap();
    r.1.cancel();
    r.0.wait().await.unwrap();
}

#[tokio::test]
async fn retention_can_differ_by_kind() {
    let env = Fleet::start().await;
    let (w, stop) = env.worker().await;
    env.submit("echo", json!({"input": {}}), "short-lived")
        .await;
    env.submit("sleep", json!({"input": {"ms": 1}}), "long-lived")
        .await;
    env.wait_status("short-lived", "completed", Duration::from_secs(10))
        .await;
    env.wait_status("long-lived", "completed", Duration::from_secs(10))
        .await;
    let r = reaper(&env, "1h", &["echo=1s"]).await;
    gone(&env, "short-lived", Duration::from_secs(15)).await;
    // Several passes later the other kind is still there.
    let mut m = r.0.metrics_watch();
    for _ in 0..3 {
        m.changed().await.unwrap();
    }
    assert!(env.jobs.get("long-lived").await.unwrap().is_some());
    stop.cancel();
    w.wait().await.unwrap();
    r.1.cancel();
    r.0.wait().await.unwrap();
}

// Issue 18: a dead job's ledger and payloads went with the kind's
// retention (7 days) while its dead letter lived 30: a late `dlq replay`
// ran its write effects again and its large input came back empty. A dead
// job now stays as long as its letter may be replayed.
#[tokio::test]
async fn a_dead_job_is_kept_as_long_as_its_dead_letter_lives() {
    let env = Fleet::with(leasehold_testkit::SetupOptions {
        ack_wait: leasehold_testkit::ACK_WAIT,
        dlq_max_age: Duration::from_secs(5),
        ..Default::default()
    })
    .await;
    let big = "z".repeat(40_000);
    for (id, status) in [("ended-dead", "dead"), ("ended-failed", "failed")] {
        let mut rec = leasehold_testkit::record::new_record(
            id,
            "echo",
            leasehold_testkit::record::JobSpec {
                input: json!({"text": big}).to_string(),
                ..Default::default()
            },
            0,
            std::time::SystemTime::now(),
        );
        rec.status = status.into();
        rec.epoch = 1;
        env.jobs.externalize(&mut rec).await.unwrap();
        env.jobs.create(&rec).await.unwrap();
        let ev = leasehold_testkit::record::event(id, 1, status, None, json!({"kind": "echo"}));
        env.events.publish(&ev, None).await.unwrap();
    }
    // A document the failed job stored before it failed: its result names
    // none, and it goes with the job all the same.
    let store = env
        .conn
        .js
        .get_object_store(env.conn.layout.artifacts_bucket())
        .await
        .unwrap();
    store
        .put("ended-failed/report.md", &mut "half a report".as_bytes())
        .await
        .unwrap();
    let t0 = tokio::time::Instant::now();
    let r = reaper(&env, "1s", &[]).await;
    gone(&env, "ended-failed", Duration::from_secs(10)).await;
    assert!(
        store.get("ended-failed/report.md").await.is_err(),
        "its unnamed document went with it"
    );
    let dead = env.jobs.get("ended-dead").await.unwrap();
    assert!(
        dead.is_some_and(|v| v.value.spec.unwrap().input.contains(&big)),
        "the dead job and its large input stay while its letter lives"
    );
    gone(&env, "ended-dead", Duration::from_secs(15)).await;
    assert!(
        t0.elapsed() >= Duration::from_secs(4),
        "not before its letter's 5 s (gone after {:?})",
        t0.elapsed()
    );
    r.1.cancel();
    r.0.wait().await.unwrap();
}

// Issue 18: a dedupe window longer than a kind's retention swallowed a
// reused id: the stream dropped the new submission as a duplicate of the
// forgotten job and `leasehold submit` said "this is the same job".
#[tokio::test]
async fn a_reused_id_swallowed_by_the_dedupe_window_is_an_error_not_a_duplicate() {
    let env = Fleet::start().await; // dedupe window: 1 h
    let (w, stop) = env.worker().await;
    let submit = |id: &'static str| {
        let url = env.url();
        async move {
            let out = tokio::process::Command::new(leasehold_harness::bin_path("leasehold"))
                .args(["submit", "echo", r#"{"input":{}}"#, "--id", id])
                .env("NATS_URL", url)
                .output()
                .await
                .unwrap();
            (
                out.status.code(),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            )
        }
    };
    assert_eq!(submit("reuse-1").await.0, Some(0));
    env.wait_status("reuse-1", "completed", Duration::from_secs(10))
        .await;
    // A duplicate of a job that is still there is the same job.
    let (code, err) = submit("reuse-1").await;
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("this is the same job"), "{err}");
    let r = reaper(&env, "1s", &[]).await;
    gone(&env, "reuse-1", Duration::from_secs(15)).await;
    let (code, err) = submit("reuse-1").await;
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("dedupe window") && err.contains("nothing was queued"),
        "{err}"
    );
    r.1.cancel();
    r.0.wait().await.unwrap();
    stop.cancel();
    w.wait().await.unwrap();
}

// Issue 18 (found by the soak's operators): a write's key was job + step +
// tool, so an id reused after retention derived the earlier job's key, and
// a destination that honours keys answered the new delivery with the old
// one's result: the new document was never delivered.
#[tokio::test]
async fn a_reused_id_delivers_its_own_document_never_the_earlier_jobs_result() {
    let env = Fleet::with(leasehold_testkit::SetupOptions {
        ack_wait: leasehold_testkit::ACK_WAIT,
        dedupe_window: Duration::from_secs(1),
        ..Default::default()
    })
    .await;
    let (_sim, base) = leasehold_testkit::spawn_sim(&[]).await;
    let _w = env.worker_proc(
        &[],
        &[
            ("LH_PUBLISH_URL", format!("{base}/effects")),
            ("LH_KINDS", "deliver".into()),
        ],
    );
    let deliver = |doc: &str| json!({"input": {"title": "t", "document": doc}});
    env.submit("deliver", deliver("first life"), "rd-1").await;
    let one = env
        .wait_status("rd-1", "completed", Duration::from_secs(20))
        .await;
    let ledger =
        leasehold_testkit::doors::ledger::open(&env.conn.js, &env.conn.layout.effects_bucket())
            .await
            .unwrap();
    let first = leasehold_testkit::doors::ledger::scan_prefix(&env.conn.js, &ledger, "rd-1")
        .await
        .unwrap();
    assert!(!first.is_empty(), "the delivery wrote its ledger entries");
    let r = reaper(&env, "1s", &[]).await;
    gone(&env, "rd-1", Duration::from_secs(15)).await;
    // The reaper purged the job's ledger entries (through store, knowing
    // no tools) before the record: nothing of the first life is left.
    let left = leasehold_testkit::doors::ledger::scan_prefix(&env.conn.js, &ledger, "rd-1")
        .await
        .unwrap();
    assert!(left.is_empty(), "ledger entries left: {left:?}");
    env.submit("deliver", deliver("second life"), "rd-1").await;
    let two = env
        .wait_status("rd-1", "completed", Duration::from_secs(20))
        .await;
    let sink: serde_json::Value = reqwest::get(format!("{base}/effects"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let docs: Vec<&str> = sink
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["body"]["document"].as_str().unwrap())
        .collect();
    assert_eq!(docs, ["first life", "second life"], "{sink}");
    let out = |r: &leasehold::JobRecord| -> serde_json::Value {
        serde_json::from_str(&r.result.as_ref().unwrap().output).unwrap()
    };
    assert_ne!(out(&one)["key"], out(&two)["key"]);
    assert_eq!(out(&two)["outcome"], "executed", "{}", out(&two));
    r.1.cancel();
    r.0.wait().await.unwrap();
}

// Issue 18: retention removed a job's events first, although its terminal
// event is the pass's only pointer to the job: a reaper killed between the
// events and the record left the record for ever (and its id blocked).
// The reaper is held at the record's removal and killed -9 there.
// The fault proxy runs in this test's runtime: it needs threads of
// its own while the test body blocks (e.g. waiting on a process).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reaper_killed_in_the_middle_of_forgetting_a_job_leaves_it_for_the_next() {
    let env = Fleet::start().await;
    let (w, stop) = env.worker().await;
    env.submit("echo", json!({"input": {}}), "half-forgotten")
        .await;
    env.wait_status("half-forgotten", "completed", Duration::from_secs(10))
        .await;
    stop.cancel();
    w.wait().await.unwrap();
    let proxy = leasehold_harness::FaultProxy::start(&env.url()).await;
    let hold = proxy.hold("$KV.lh_jobs.half-forgotten");
    let mut a = leasehold_harness::Proc::spawn(
        "leasehold-reaper",
        &[],
        &[
            ("NATS_URL", proxy.url()),
            ("LH_RETENTION", "1s".into()),
            ("LH_INTERVAL", "300ms".into()),
            ("RUST_LOG", "info".into()),
        ],
    );
    tokio::time::timeout(Duration::from_secs(20), hold.triggered())
        .await
        .expect("the reaper reached the record's removal");
    a.kill9();
    proxy.cut();
    assert!(env.jobs.get("half-forgotten").await.unwrap().is_some());
    assert!(
        env.events_of("half-forgotten")
            .await
            .iter()
            .any(|e| e.r#type == "completed"),
        "the terminal event, the pointer to the job, is still there"
    );
    let r = reaper(&env, "1s", &[]).await;
    gone(&env, "half-forgotten", Duration::from_secs(15)).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !env.events_of("half-forgotten").await.is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "its events went last"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    r.1.cancel();
    r.0.wait().await.unwrap();
}

// Issue 30, G19: the pass purged a job's events up to its terminal event
// only, so what landed after it (a stale owner's unfenced `heartbeat_lost`,
// an operator's `action`) stayed for ever and showed in the timeline of
// the id's next job.
#[tokio::test]
async fn events_after_the_terminal_event_go_with_the_job() {
    let env = Fleet::start().await;
    let (w, stop) = env.worker().await;
    env.submit("echo", json!({"input": {"late": 1}}), "late-ev")
        .await;
    let done = env
        .wait_status("late-ev", "completed", Duration::from_secs(10))
        .await;
    // The terminal event follows the record's write.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !env
        .events_of("late-ev")
        .await
        .iter()
        .any(|e| e.r#type == "completed")
    {
        assert!(tokio::time::Instant::now() < deadline, "no completed event");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // After the terminal event: a stale owner that found its claim gone,
    // and an operator's action on the finished job.
    for (ty, data) in [
        ("heartbeat_lost", json!({"reason": "claim gone"})),
        (
            "action",
            json!({"action": "cancel", "by": "ops", "via": "console"}),
        ),
    ] {
        let ev = leasehold_testkit::record::event("late-ev", done.epoch, ty, Some("stale-w"), data);
        env.events.publish(&ev, None).await.unwrap();
    }
    let types: Vec<String> = env
        .events_of("late-ev")
        .await
        .into_iter()
        .map(|e| e.r#type)
        .collect();
    assert_eq!(
        types.iter().rev().take(2).collect::<Vec<_>>(),
        ["action", "heartbeat_lost"]
    );
    let r = reaper(&env, "1s", &[]).await;
    gone(&env, "late-ev", Duration::from_secs(15)).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while r
        .0
        .stats
        .forgotten
        .load(std::sync::atomic::Ordering::Relaxed)
        == 0
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the pass never counted the job"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let left = env.events_of("late-ev").await;
    assert!(left.is_empty(), "events left behind: {left:?}");
    stop.cancel();
    w.wait().await.unwrap();
    r.1.cancel();
    r.0.wait().await.unwrap();
}

// Issue 30, G17: index removal compared epochs only, and a reused id starts
// again at epoch 1. A remover that read the record of the id's earlier
// incarnation (epoch 5), then paused while retention forgot it and the id
// was submitted again, deleted the new job's entry when it resumed.
#[tokio::test]
async fn a_paused_remover_of_an_earlier_incarnation_keeps_the_reused_ids_entry() {
    use leasehold_testkit::doors::index::Key;
    let env = Fleet::start().await;
    let (w, stop) = env.worker().await;
    // What the paused remover read: the earlier incarnation, dead at epoch 5.
    let mut old = leasehold_testkit::record::new_record(
        "reused",
        "sleep",
        Default::default(),
        0,
        std::time::SystemTime::now() - Duration::from_secs(7200),
    );
    old.status = "dead".into();
    old.epoch = 5;
    // The id's new job, waiting (delayed) with its index entry.
    env.submit(
        "sleep",
        json!({"input": {"ms": 1}, "delay": "1h"}),
        "reused",
    )
    .await;
    env.wait_status("reused", "queued", Duration::from_secs(10))
        .await;
    let active = env.active().await;
    let wait = Key::Wait {
        job: "reused".into(),
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !active.keys_of("reused").await.unwrap().contains(&wait) {
        assert!(tokio::time::Instant::now() < deadline, "never indexed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The remover resumes, as every remover does: by what it read.
    for k in active.keys_of("reused").await.unwrap() {
        active.remove(&k, &old).await.unwrap();
    }
    assert!(
        active.keys_of("reused").await.unwrap().contains(&wait),
        "the new incarnation's entry was removed by a remover of the old one"
    );
    // Its own incarnation's remover still removes it.
    let cur = env.record("reused").await.unwrap();
    let mut finished = cur.clone();
    finished.epoch += 1;
    active.remove(&wait, &finished).await.unwrap();
    assert!(!active.keys_of("reused").await.unwrap().contains(&wait));
    stop.cancel();
    w.wait().await.unwrap();
}
