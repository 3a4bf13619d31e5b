//! Durable timers (`ctx.sleep`): a sleeping job holds no worker, is
//! `waiting` and listed, and wakes at its time on any worker, across a
//! kill -9, a restart of the whole fleet (every worker and the NATS
//! server), and a worker killed after its write and before its wake-up.

use std::time::{Duration, SystemTime};

use leasehold_harness::{wait_for_jetstream, FaultProxy};
use leasehold_testkit::doors::index::Key;
use leasehold_testkit::record::parse_rfc3339;
use leasehold_testkit::{wait_log, Fleet};
use serde_json::json;

fn ms(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// What every sleeping job's end shows: it ran `after` once its time had
/// come, each step once, and waited once.
async fn slept_once(env: &Fleet, id: &str, until: SystemTime) {
    let done = env.record(id).await.unwrap();
    assert_eq!(done.status, "completed", "{done:?}");
    let out: serde_json::Value =
        serde_json::from_str(&done.result.as_ref().unwrap().output).unwrap();
    assert!(
        out["after_ms"].as_u64().unwrap() >= ms(until),
        "woke before its time: {out} (until {})",
        ms(until)
    );
    assert!(out["before_ms"].as_u64().unwrap() < ms(until), "{out}");
    assert_eq!(
        env.steps_recorded(id, "before#0").await,
        1,
        "the step before ran once"
    );
    assert_eq!(env.steps_recorded(id, "sleep#0").await, 1);
    assert_eq!(env.steps_recorded(id, "after#0").await, 1);
    // A finished job leaves no index entry (removed after its end's event).
    env.wait_unindexed(id, Duration::from_secs(10)).await;
}

#[tokio::test]
async fn a_sleeping_job_holds_no_slot_is_listed_waiting_and_wakes_at_its_time() {
    let env = Fleet::with_kind("nap").await;
    let (w, stop) = env.one_slot_worker("nap", leasehold_tests::Nap).await;
    env.submit("nap", json!({"input": {"ms": 3000}}), "nap-1")
        .await;
    let asleep = env
        .wait_status("nap-1", "waiting", Duration::from_secs(10))
        .await;
    assert_eq!(asleep.waiting_for.as_deref(), Some("time"));
    assert_eq!(asleep.waiting_step.as_deref(), Some("sleep#0"));
    assert_eq!(asleep.session, None, "no worker holds a sleeping job");
    assert_eq!(asleep.ticket_seq, 0, "a sleeping job holds no ticket");
    let until = parse_rfc3339(asleep.next_run_at.as_deref().unwrap()).unwrap();
    assert!(until > SystemTime::now() + Duration::from_secs(1));
    env.wait_listed("nap-1", "held", Duration::from_secs(5), |k| {
        matches!(k, Key::Hold { .. })
    })
    .await;
    let waited = env
        .wait_event("nap-1", "waiting", Duration::from_secs(5))
        .await;
    let ev = waited.last().unwrap().data_map();
    assert_eq!(
        (ev["for"].as_str(), ev["step"].as_str()),
        (Some("time"), Some("sleep#0"))
    );

    // Its one slot is free: another job runs while it sleeps.
    env.submit("echo", json!({"input": {"n": 1}}), "meanwhile")
        .await;
    env.wait_status("meanwhile", "completed", Duration::from_secs(10))
        .await;
    assert_eq!(env.record("nap-1").await.unwrap().status, "waiting");

    env.wait_status("nap-1", "completed", Duration::from_secs(15))
        .await;
    slept_once(&env, "nap-1", until).await;
    assert_eq!(
        w.metrics
            .total(leasehold::Count::Ended(leasehold::AttemptOutcome::Waited)),
        1
    );
    stop.cancel();
    w.wait().await.unwrap();
}

#[tokio::test]
async fn a_sleep_survives_a_kill9_and_a_restart_of_the_whole_fleet() {
    let mut env = Fleet::with_kind("nap").await;
    let mut a = env.sdk_worker(&env.url(), "nap-a", "nap");
    wait_log(&a, "worker starting", Duration::from_secs(20)).await;
    env.submit("nap", json!({"input": {"ms": 5000}}), "nap-fleet")
        .await;
    let asleep = env
        .wait_status("nap-fleet", "waiting", Duration::from_secs(15))
        .await;
    let until = parse_rfc3339(asleep.next_run_at.as_deref().unwrap()).unwrap();
    env.wait_event("nap-fleet", "waiting", Duration::from_secs(5))
        .await;
    // Every process goes: the worker (kill -9), then the server.
    a.kill9();
    env.server.kill();
    env.server.restart();
    wait_for_jetstream(&env.url(), Duration::from_secs(20)).await;
    let _b = env.sdk_worker(&env.url(), "nap-b", "nap");
    env.wait_status("nap-fleet", "completed", Duration::from_secs(30))
        .await;
    slept_once(&env, "nap-fleet", until).await;
}

/// The moment that matters: the owner wrote `waiting` and its index entry,
/// and died before its wake-up (`due.<job>`) was written. Its ticket was
/// never acked: its next delivery finds the job waiting, writes the
/// wake-up, and the job wakes at the time it first asked for.
#[tokio::test]
async fn a_worker_killed_before_its_wake_up_was_written_leaves_the_ticket_to_write_it() {
    let env = Fleet::with_kind("nap").await;
    let proxy = FaultProxy::start(&env.url()).await;
    let hold = proxy.hold("$KV.lh_active.due.>");
    let mut a = env.sdk_worker(&proxy.url(), "nap-a", "nap");
    wait_log(&a, "worker starting", Duration::from_secs(20)).await;
    env.submit("nap", json!({"input": {"ms": 3000}}), "nap-cut")
        .await;
    tokio::time::timeout(Duration::from_secs(15), hold.triggered())
        .await
        .expect("the owner reached its wake-up write");
    a.kill9();
    let asleep = env.record("nap-cut").await.unwrap();
    assert_eq!(asleep.status, "waiting");
    let until = parse_rfc3339(asleep.next_run_at.as_deref().unwrap()).unwrap();
    assert!(
        env.active()
            .await
            .kv()
            .get("due.nap-cut")
            .await
            .unwrap()
            .is_none(),
        "no wake-up was written"
    );
    let _b = env.sdk_worker(&env.url(), "nap-b", "nap");
    let done = env
        .wait_status("nap-cut", "completed", Duration::from_secs(30))
        .await;
    slept_once(&env, "nap-cut", until).await;
    // It slept once, for the time it first asked: its wait was the
    // record's, not an event's (none was published).
    let out: serde_json::Value = serde_json::from_str(&done.result.unwrap().output).unwrap();
    assert!(
        out["after_ms"].as_u64().unwrap() < ms(until) + 5_000,
        "slept twice: {out} (until {})",
        ms(until)
    );
}

/// A sleeping job is listed waiting with its time and step, and a cancel
/// ends it at once: its wake-up, when it comes, changes nothing.
#[tokio::test]
async fn a_waiting_job_is_listed_with_its_time_and_a_cancel_ends_it_for_good() {
    let env = Fleet::with_kind("nap").await;
    let a = env.sdk_worker(&env.url(), "nap-a", "nap");
    wait_log(&a, "worker starting", Duration::from_secs(20)).await;
    env.submit("nap", json!({"input": {"ms": 2000}}), "nap-off")
        .await;
    let asleep = env
        .wait_status("nap-off", "waiting", Duration::from_secs(15))
        .await;
    let until = parse_rfc3339(asleep.next_run_at.as_deref().unwrap()).unwrap();
    env.wait_listed("nap-off", "held", Duration::from_secs(5), |k| {
        matches!(k, Key::Hold { .. })
    })
    .await;
    let (code, out, err) =
        leasehold_testkit::cli(&env.url(), &["list", "--status", "waiting"]).await;
    assert_eq!(code, 0, "{err}");
    let row = out
        .lines()
        .find(|l| l.starts_with("nap-off "))
        .unwrap_or_else(|| panic!("not listed:\n{out}"));
    assert!(
        row.contains("waiting") && row.contains("waits for time until") && row.contains("sleep#0"),
        "{row}"
    );
    let (code, out, err) = leasehold_testkit::cli(&env.url(), &["cancel", "nap-off"]).await;
    assert_eq!(code, 0, "{out}{err}");
    let done = env
        .wait_status("nap-off", "cancelled", Duration::from_secs(10))
        .await;
    assert_eq!(done.error.unwrap().message, "cancelled while waiting");
    // Its wake-up fires at its time (a worker of its kind runs) and,
    // finding it cancelled, does nothing but go.
    let active = env.active().await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while active.kv().get("due.nap-off").await.unwrap().is_some() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the wake-up never fired"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        SystemTime::now() >= until,
        "the wake-up went before its time"
    );
    assert_eq!(env.record("nap-off").await.unwrap().status, "cancelled");
    assert_eq!(env.steps_recorded("nap-off", "after#0").await, 0);
}

/// Found by the timers bench: every attempt reads its journal, and each
/// read left an ordered consumer on `LH_EVENTS` for 30 s. A thousand
/// timers waking together ran the server into its consumer limit (10026)
/// and their attempts failed. A read's consumer now goes within seconds of
/// the read (2 s of idleness), without a delete a read-only user could not
/// send.
#[tokio::test]
async fn a_jobs_event_reads_leave_no_consumer_for_long() {
    let env = Fleet::with_kind("nap").await;
    let (_w, stop) = env.worker().await;
    env.submit("echo", json!({"input": {}}), "read-me").await;
    env.wait_event("read-me", "completed", Duration::from_secs(10))
        .await;
    let mut stream = env
        .conn
        .js
        .get_stream(env.conn.layout.events_stream())
        .await
        .unwrap();
    stop.cancel();
    let before = stream.info().await.unwrap().state.consumer_count;
    let t0 = tokio::time::Instant::now();
    for _ in 0..50 {
        assert!(!env.events_of("read-me").await.is_empty());
    }
    // Well inside the 30 s an ordered consumer would stay.
    loop {
        let left = stream.info().await.unwrap().state.consumer_count - before;
        if left == 0 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(12),
            "{left} reader consumers still there after {:?}",
            t0.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}
