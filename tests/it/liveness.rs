//! Worker liveness by session, recovery that never waits for the consumer's
//! ack wait, and the index of active jobs, with real processes killed,
//! paused and partitioned at the moments that matter.

use std::time::Duration;

use leasehold_harness::FaultProxy;
use leasehold_testkit::doors::index::{Active, Filter, Key};
use leasehold_testkit::SetupOptions;
use serde_json::json;

use leasehold_testkit::{wait_log, Fleet};

/// An environment made by a plain `leasehold setup`, but with a consumer ack
/// wait three times the default session timeout (an earlier release's
/// default, 30 s): a recovery well within it did not wait for a redelivery.
async fn default_env() -> Fleet {
    Fleet::with(SetupOptions {
        ack_wait: Duration::from_secs(30),
        ..SetupOptions::default()
    })
    .await
}

async fn active(env: &Fleet) -> Active {
    env.active().await
}

/// Tickets left in the work stream.
async fn tickets(env: &Fleet) -> u64 {
    let mut s = env
        .conn
        .js
        .get_stream(env.conn.layout.work_stream())
        .await
        .unwrap();
    s.info().await.unwrap().state.messages
}

#[tokio::test]
async fn kill9_is_recovered_by_the_session_timeout_not_the_ack_wait() {
    let env = default_env().await;
    let mut a = env.worker_proc(&[], &[]);
    env.submit("sleep", json!({"input": {"ms": 4000}}), "k9")
        .await;
    let first = env
        .wait_status("k9", "running", Duration::from_secs(15))
        .await;
    env.wait_indexed("k9", Duration::from_secs(10)).await;
    a.kill9();
    let t0 = tokio::time::Instant::now();
    // No reaper: the surviving worker handles the ended session itself.
    let (b, stop) = env.worker().await;
    let moved = env
        .wait_for("k9", Duration::from_secs(20), |r| {
            r.status == "running" && r.worker_id.as_deref() == Some(b.worker_id.as_str())
        })
        .await;
    let took = t0.elapsed();
    // The session timeout is 2 s; the consumer's ack wait is 30 s.
    assert!(
        took < Duration::from_secs(8),
        "recovered after {took:?}: must follow the 2 s session, not the 30 s ack wait"
    );
    assert_ne!(first.worker_id, moved.worker_id);
    assert_eq!((moved.epoch, moved.stale_reclaims), (2, 1));
    env.wait_status("k9", "completed", Duration::from_secs(20))
        .await;
    stop.cancel();
    b.wait().await.unwrap();
}

#[tokio::test]
async fn a_reaper_notices_a_killed_worker_long_before_its_default_session_ends() {
    let env = default_env().await;
    // The default session timeout (10 s): only the reaper's probe of the
    // closed connection can make this fast. The probe ends the session in
    // about a second; its jobs move once the process still does not answer
    // a settle time later (a worker only reconnecting keeps them, G4).
    let mut a = env.worker_proc(&[], &[("LH_SESSION_TIMEOUT", "10s".into())]);
    let r = env.reaper().await;
    env.submit("sleep", json!({"input": {"ms": 6000}}), "fast")
        .await;
    env.wait_status("fast", "running", Duration::from_secs(15))
        .await;
    env.wait_indexed("fast", Duration::from_secs(10)).await;
    let (b, stop_b) = env.worker().await;
    a.kill9();
    let t0 = tokio::time::Instant::now();
    env.wait_for("fast", Duration::from_secs(20), |r| r.epoch == 2)
        .await;
    let took = t0.elapsed();
    let bound = Duration::from_secs(1)
        + leasehold_testkit::doors::owner::SETTLE_AFTER_RECONNECT
        + Duration::from_secs(2);
    assert!(
        took < bound,
        "a closed connection is noticed by the probe and a settle time, not the 10 s session: {took:?} (bound {bound:?})"
    );
    assert!(
        r.0.stats
            .sessions_ended_fast
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 1
    );
    env.wait_status("fast", "completed", Duration::from_secs(20))
        .await;
    r.1.cancel();
    r.0.wait().await.unwrap();
    stop_b.cancel();
    b.wait().await.unwrap();
}

#[tokio::test]
async fn two_reapers_reoffer_a_dead_sessions_jobs_exactly_once() {
    let env = default_env().await;
    let mut a = env.worker_proc(&[], &[("LH_CONCURRENCY", "8".into())]);
    let ids: Vec<String> = (0..4).map(|i| format!("orphan-{i}")).collect();
    for id in &ids {
        env.submit("sleep", json!({"input": {"ms": 30000}}), id)
            .await;
    }
    for id in &ids {
        env.wait_status(id, "running", Duration::from_secs(15))
            .await;
        env.wait_indexed(id, Duration::from_secs(10)).await;
    }
    // Every ticket settled: the running jobs live on A's session alone.
    assert_eq!(tickets(&env).await, 0);
    let r1 = env.reaper().await;
    let r2 = env.reaper().await;
    a.kill9();
    for id in &ids {
        let q = env.wait_status(id, "queued", Duration::from_secs(15)).await;
        assert_eq!(q.stale_reclaims, 1);
    }
    // Let both replicas sweep a few more times.
    let (mut w1, mut w2) = (r1.0.metrics_watch(), r2.0.metrics_watch());
    for _ in 0..3 {
        w1.changed().await.unwrap();
        w2.changed().await.unwrap();
    }
    assert_eq!(
        tickets(&env).await,
        ids.len() as u64,
        "one new ticket per orphaned job"
    );
    for id in &ids {
        let reoffers = env
            .events_of(id)
            .await
            .iter()
            .filter(|e| e.r#type == "progress" && e.data_map().get("recovered").is_some())
            .count();
        assert_eq!(reoffers, 1, "{id}: re-offered once");
        let writes = env
            .jobs
            .history(id)
            .await
            .unwrap()
            .iter()
            .filter(|v| v.value.status == "queued" && v.value.stale_reclaims == 1)
            .count();
        assert_eq!(writes, 1, "{id}: one release write");
    }
    let idx = active(&env).await;
    assert_eq!(idx.list(Filter::Waiting).await.unwrap().len(), ids.len());
    assert!(idx.list(Filter::Running).await.unwrap().is_empty());
    // A worker now runs them to completion.
    let (b, stop) = env.worker().await;
    for id in &ids {
        let done = env
            .wait_status(id, "completed", Duration::from_secs(60))
            .await;
        assert_eq!(done.epoch, 2);
    }
    // The entries go right after each completion.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !idx.list(Filter::All).await.unwrap().is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "index not empty once all finished: {:?}",
            idx.list(Filter::All).await.unwrap()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for r in [r1, r2] {
        r.1.cancel();
        r.0.wait().await.unwrap();
    }
    stop.cancel();
    b.wait().await.unwrap();
}

// The fault proxy runs in this test's runtime: it needs threads of
// its own while the test body blocks (e.g. waiting on a process).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_worker_loses_its_jobs_and_comes_back_without_writing() {
    let env = default_env().await;
    let proxy = FaultProxy::start(&env.url()).await;
    let a = env.worker_proc(&["--worker-id", "part-a"], &[("NATS_URL", proxy.url())]);
    wait_log(&a, "worker starting", Duration::from_secs(10)).await;
    env.submit("sleep", json!({"input": {"ms": 5000}}), "cut-off")
        .await;
    env.wait_for("cut-off", Duration::from_secs(15), |r| {
        r.status == "running" && r.worker_id.as_deref() == Some("part-a")
    })
    .await;
    env.wait_indexed("cut-off", Duration::from_secs(10)).await;
    proxy.freeze();
    let (b, stop) = env.worker().await;
    let moved = env
        .wait_for("cut-off", Duration::from_secs(20), |r| {
            r.worker_id.as_deref() == Some(b.worker_id.as_str())
        })
        .await;
    assert_eq!((moved.epoch, moved.stale_reclaims), (2, 1));
    let done = env
        .wait_status("cut-off", "completed", Duration::from_secs(20))
        .await;
    proxy.thaw();
    // A notices it lost the job: when it re-checks its jobs after writing
    // its session again, or, when its sleep ended first (a loaded
    // machine), when its completion is refused. Either way without writing.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let out = a.output();
        if out.contains("re-offered while this process was away")
            || out.contains("ownership lost: completion refused")
        {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "A never noticed it lost the job:\n{out}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let history = env.jobs.history("cut-off").await.unwrap();
    let claim_b = history.iter().position(|v| v.value.epoch == 2).unwrap();
    assert!(
        history[claim_b..].iter().all(|v| v.value.epoch == 2),
        "no write of A's epoch after B's claim"
    );
    assert_eq!(env.record("cut-off").await.unwrap(), done);
    // A serves new work on its restored session.
    env.submit("echo", json!({"input": {"back": true}}), "after-partition")
        .await;
    env.wait_status("after-partition", "completed", Duration::from_secs(15))
        .await;
    stop.cancel();
    b.wait().await.unwrap();
}

// A ticket delivered to a worker that dies before its claim is known only
// to the consumer: no record, no index entry, no session naming it. Only the
// ack wait brings it back, so the default ack wait is the session timeout
// (the soak saw fresh jobs wait the 30 s of the earlier default).
// The fault proxy runs in this test's runtime: it needs threads of
// its own while the test body blocks (e.g. waiting on a process).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ticket_whose_worker_died_before_claiming_runs_within_a_session_timeout() {
    let defaults = SetupOptions::default();
    let env = Fleet::with(defaults.clone()).await;
    let proxy = FaultProxy::start(&env.url()).await;
    let mut a = env.worker_proc(&["--worker-id", "died-a"], &[("NATS_URL", proxy.url())]);
    wait_log(&a, "worker starting", Duration::from_secs(10)).await;
    // A's first write for the job, the claim that creates its record, is held.
    let hold = proxy.hold(&format!("$KV.{}.>", env.conn.layout.jobs_bucket()));
    env.submit("echo", json!({"input": {"n": 1}}), "unclaimed")
        .await;
    hold.triggered().await;
    a.kill9();
    // The kernel closes a killed process's socket: so does the proxy (the
    // held claim goes nowhere).
    proxy.cut();
    let t0 = tokio::time::Instant::now();
    assert!(
        env.jobs.get("unclaimed").await.unwrap().is_none(),
        "the claim never reached the server"
    );
    let (b, stop) = env.worker().await;
    let done = env
        .wait_status("unclaimed", "completed", Duration::from_secs(45))
        .await;
    let took = t0.elapsed();
    // The worker's default `--session-timeout`: a claimed job of a dead
    // worker moves within it, and so must one it never claimed.
    let session_timeout = Duration::from_secs(10);
    assert!(
        took < session_timeout + Duration::from_secs(3),
        "ran {took:?} after its worker died (default ack wait {:?}): not within the default session timeout",
        defaults.ack_wait
    );
    assert_eq!(done.worker_id.as_deref(), Some(b.worker_id.as_str()));
    assert_eq!((done.epoch, done.stale_reclaims), (1, 0), "one claim, B's");
    let history = env.jobs.history("unclaimed").await.unwrap();
    assert!(
        history
            .iter()
            .all(|v| v.value.worker_id.as_deref() != Some("died-a")),
        "nothing of A's reached the record"
    );
    stop.cancel();
    b.wait().await.unwrap();
}

// The fault proxy runs in this test's runtime: it needs threads of
// its own while the test body blocks (e.g. waiting on a process).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_between_the_claim_and_its_index_entry_is_recovered() {
    let env = default_env().await;
    let proxy = FaultProxy::start(&env.url()).await;
    let mut a = env.worker_proc(&[], &[("NATS_URL", proxy.url())]);
    wait_log(&a, "worker starting", Duration::from_secs(10)).await;
    // The claim is written; the index entry that follows is held.
    let hold = proxy.hold(&format!("$KV.{}.>", env.conn.layout.active_bucket()));
    env.submit("sleep", json!({"input": {"ms": 2000}}), "between")
        .await;
    hold.triggered().await;
    a.kill9();
    let rec = env.record("between").await.unwrap();
    assert_eq!(rec.status, "running", "the claim landed");
    assert!(active(&env)
        .await
        .keys_of("between")
        .await
        .unwrap()
        .is_empty());
    // Its ticket, NAKed at the claim with a one-session wake-up, brings it back.
    let (b, stop) = env.worker().await;
    let done = env
        .wait_status("between", "completed", Duration::from_secs(30))
        .await;
    assert_eq!(done.worker_id.as_deref(), Some(b.worker_id.as_str()));
    // The entry goes right after the record's end, not with it.
    let idx = active(&env).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !idx.keys_of("between").await.unwrap().is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the finished job's index entry stayed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.cancel();
    b.wait().await.unwrap();
}

/// With the consumer's ack wait equal to the session timeout (the product's
/// defaults: 10 s each), a claim sends no wake-up NAK: the ticket's own
/// redelivery is the wake-up. A worker killed between its claim and its
/// index entry still loses nothing: the job runs again from its ticket,
/// once more, and completes.
// The fault proxy runs in this test's runtime: it needs threads of
// its own while the test body blocks (e.g. waiting on a process).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_wake_up_nak_the_ack_wait_recovers_a_job_killed_before_its_index_entry() {
    let env = Fleet::with(SetupOptions {
        ack_wait: Duration::from_secs(3),
        ..SetupOptions::default()
    })
    .await;
    let proxy = FaultProxy::start(&env.url()).await;
    let mut a = env.worker_proc(
        &[],
        &[
            ("NATS_URL", proxy.url()),
            ("LH_SESSION_TIMEOUT", "3s".into()),
        ],
    );
    wait_log(&a, "worker starting", Duration::from_secs(10)).await;
    // The claim is written; the index entry that follows is held.
    let hold = proxy.hold(&format!("$KV.{}.>", env.conn.layout.active_bucket()));
    env.submit("sleep", json!({"input": {"ms": 1500}}), "no-nak")
        .await;
    hold.triggered().await;
    let acks = format!("$JS.ACK.{}.>", env.conn.layout.work_stream());
    assert_eq!(
        proxy.published(&acks),
        0,
        "the claim sent no wake-up NAK (the ack wait is the wake-up)"
    );
    a.kill9();
    assert_eq!(env.record("no-nak").await.unwrap().status, "running");
    let (b, stop) = env.worker().await;
    let done = env
        .wait_status("no-nak", "completed", Duration::from_secs(30))
        .await;
    assert_eq!(done.worker_id.as_deref(), Some(b.worker_id.as_str()));
    // The record is written before its `completed` event.
    env.wait_event("no-nak", "completed", Duration::from_secs(10))
        .await;
    let events = env.events_of("no-nak").await;
    let count = |t: &str| events.iter().filter(|e| e.r#type == t).count();
    assert_eq!(
        (count("claimed"), count("completed")),
        (2, 1),
        "claimed by the killed worker, then once from the redelivered ticket"
    );
    stop.cancel();
    b.wait().await.unwrap();
}

// The fault proxy runs in this test's runtime: it needs threads of
// its own while the test body blocks (e.g. waiting on a process).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_between_completion_and_its_index_removal_leaves_nothing_behind() {
    let env = default_env().await;
    let proxy = FaultProxy::start(&env.url()).await;
    let mut a = env.worker_proc(&[], &[("NATS_URL", proxy.url())]);
    wait_log(&a, "worker starting", Duration::from_secs(10)).await;
    env.submit("sleep", json!({"input": {"ms": 1500}}), "stale-entry")
        .await;
    env.wait_status("stale-entry", "running", Duration::from_secs(15))
        .await;
    env.wait_indexed("stale-entry", Duration::from_secs(10))
        .await;
    // The completion lands; the index removal after it is held.
    let hold = proxy.hold(&format!("$KV.{}.>", env.conn.layout.active_bucket()));
    env.wait_status("stale-entry", "completed", Duration::from_secs(15))
        .await;
    hold.triggered().await;
    a.kill9();
    assert!(
        !active(&env)
            .await
            .keys_of("stale-entry")
            .await
            .unwrap()
            .is_empty(),
        "the entry outlived the completion"
    );
    // The ended session's recovery finds the entry, reads the record, and
    // removes it; nothing is re-run.
    let (b, stop) = env.worker().await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !active(&env)
        .await
        .keys_of("stale-entry")
        .await
        .unwrap()
        .is_empty()
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "stale entry never repaired"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let rec = env.record("stale-entry").await.unwrap();
    assert_eq!((rec.status.as_str(), rec.epoch), ("completed", 1));
    stop.cancel();
    b.wait().await.unwrap();
}

#[tokio::test]
async fn a_hundred_thousand_finished_records_cost_the_active_paths_nothing() {
    let env = default_env().await;
    // History seeded with direct KV writes, as years of finished jobs.
    let kv = env.jobs.kv().clone();
    let n = 100_000;
    let mut pending = futures::stream::FuturesUnordered::new();
    for i in 0..n {
        let mut r = leasehold_testkit::record::new_record(
            &format!("old-{i}"),
            "echo",
            Default::default(),
            0,
            std::time::SystemTime::now(),
        );
        r.status = "completed".into();
        let kv = kv.clone();
        pending.push(async move {
            kv.put(r.id.clone(), serde_json::to_vec(&r).unwrap().into())
                .await
                .unwrap()
        });
        if pending.len() >= 512 {
            futures::StreamExt::next(&mut pending).await;
        }
    }
    while futures::StreamExt::next(&mut pending).await.is_some() {}
    // The usual work: a worker with a stable identity (its start reclaims
    // from the index), a reaper, jobs that complete and one that runs.
    let mut o = env.opts();
    o.worker_id = Some("history-w".into());
    let t0 = tokio::time::Instant::now();
    let (w, stop) = env.worker_with(o).await;
    let started = t0.elapsed();
    let r = env.reaper().await;
    for i in 0..20 {
        env.submit("echo", json!({"input": {"i": i}}), &format!("new-{i}"))
            .await;
    }
    env.submit("sleep", json!({"input": {"ms": 3000}}), "live")
        .await;
    for i in 0..20 {
        env.wait_status(&format!("new-{i}"), "completed", Duration::from_secs(20))
            .await;
    }
    env.wait_indexed("live", Duration::from_secs(10)).await;
    let idx = active(&env).await;
    let t1 = tokio::time::Instant::now();
    let running = idx.list(Filter::Running).await.unwrap();
    let listed = t1.elapsed();
    assert_eq!(running.len(), 1);
    assert!(matches!(&running[0].0, Key::Run { job, .. } if job == "live"));
    // A sweep that started after the job was indexed.
    let mut m = r.0.metrics_watch();
    m.changed().await.unwrap();
    m.changed().await.unwrap();
    let snap = r.0.metrics();
    assert_eq!(snap.jobs, 1, "the sweep saw the active job only: {snap:?}");
    // Generous bounds for a loaded CI machine; a scan of 100k records takes
    // tens of seconds here.
    assert!(
        started < Duration::from_secs(5),
        "worker start took {started:?}"
    );
    assert!(
        listed < Duration::from_secs(1),
        "listing running jobs took {listed:?}"
    );
    env.wait_status("live", "completed", Duration::from_secs(20))
        .await;
    r.1.cancel();
    r.0.wait().await.unwrap();
    stop.cancel();
    w.wait().await.unwrap();
}

/// Found by the 30-minute cluster soak: an attempt that ends without its
/// outcome written (the write refused for another reason than lost
/// ownership) leaves a record that names a live worker which no longer
/// runs the job; the session never ends, so nothing would ever move it.
/// The reaper asks live owners whether they run what the index says, and
/// re-offers what they do not; what they do run is left alone.
#[tokio::test]
async fn a_job_its_live_owner_does_not_run_is_reoffered() {
    let env = default_env().await;
    let (w, stop) = env.worker().await;
    env.submit("sleep", json!({"input": {"ms": 60_000}}), "held")
        .await;
    env.wait_status("held", "running", Duration::from_secs(15))
        .await;
    env.wait_indexed("held", Duration::from_secs(10)).await;
    // A record exactly like the one the live worker holds, for a job it
    // does not run, indexed under it, with no ticket: what the soak's
    // refused write left behind.
    let held = env.record("held").await.unwrap();
    let mut ghost = held.clone();
    ghost.id = "ghost".into();
    ghost.kind = "echo".into();
    ghost.ticket_seq = 0;
    if let Some(s) = ghost.spec.as_mut() {
        s.id = Some("ghost".into());
        s.input = json!({"n": 1}).to_string();
    }
    env.jobs.create(&ghost).await.unwrap();
    let idx = active(&env).await;
    idx.put(
        &Key::Run {
            worker: w.worker_id.clone(),
            job: "ghost".into(),
        },
        &ghost,
    )
    .await
    .unwrap();
    // Re-offered, it runs again wherever a slot is free.
    let (b, bstop) = env.worker().await;
    let (r, rstop) = env.reaper().await;
    let done = env
        .wait_status("ghost", "completed", Duration::from_secs(30))
        .await;
    assert_eq!(
        (done.epoch, done.stale_reclaims),
        (2, 1),
        "re-offered once, claimed anew"
    );
    // The job the worker does run was not touched.
    let still = env.jobs.get("held").await.unwrap().unwrap();
    assert_eq!(
        (still.value.status.as_str(), still.value.epoch),
        ("running", 1),
        "a job its owner runs is never re-offered"
    );
    rstop.cancel();
    r.wait().await.unwrap();
    for (h, s) in [(w, stop), (b, bstop)] {
        s.cancel();
        h.wait().await.unwrap();
    }
}

// A's index write is held at the proxy and A is paused (SIGSTOP) with it in
// flight; its session ends and B reclaims the job from the ticket's
// wake-up. When A resumes, its index task completes: before, it acked the
// ticket it held, which by then was B's wake-up, so with B killed before
// its own `--index-after` nothing covered the job (no ticket, no entry
// under B) and no surviving worker could recover it.
// The fault proxy runs in this test's runtime: it needs threads of
// its own while the test body blocks (e.g. waiting on a process).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_index_write_of_a_paused_owner_leaves_the_new_owners_cover_alone() {
    let env = Fleet::start().await;
    let proxy = FaultProxy::start(&env.url()).await;
    let a = env.worker_proc(&["--worker-id", "late-a"], &[("NATS_URL", proxy.url())]);
    wait_log(&a, "worker starting", Duration::from_secs(10)).await;
    let hold = proxy.hold(&format!("$KV.{}.>", env.conn.layout.active_bucket()));
    env.submit("sleep", json!({"input": {"ms": 6000}}), "late-index")
        .await;
    tokio::time::timeout(Duration::from_secs(15), hold.triggered())
        .await
        .expect("A's index write reached the proxy");
    a.stop();
    // B takes the job from its ticket's wake-up once A's session ended; B
    // would index it only after 30 s on its own.
    let mut b = env.worker_proc(
        &["--worker-id", "late-b"],
        &[("LH_INDEX_AFTER", "30s".into())],
    );
    env.wait_for("late-index", Duration::from_secs(20), |r| {
        r.worker_id.as_deref() == Some("late-b") && r.status == "running"
    })
    .await;
    hold.release();
    a.cont();
    // A's index task finishes: it sees the job is B's now (or, as before,
    // acks B's wake-up: the ticket is gone).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !a
        .output()
        .contains("the job moved on before its index write")
        && tickets(&env).await > 0
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "A's index task never ended:\n{}",
            a.output()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    b.kill9();
    // A outlives B: its watcher of ended sessions recovers the job from
    // B's index entry, and it runs again (on A, the only worker left).
    let done = env
        .wait_status("late-index", "completed", Duration::from_secs(30))
        .await;
    assert_eq!(done.worker_id.as_deref(), Some("late-a"));
    assert_eq!(
        done.epoch, 3,
        "A's claim, B's reclaim, the recovery's claim"
    );
    // The index follows the record's last write.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let keys = active(&env).await.keys_of("late-index").await.unwrap();
        if keys.is_empty() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "nothing of the job left in the index: {keys:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

// A remover that read the job at one epoch and acts late (a paused
// recoverer, a claim's old-entry removal, a same-id takeover) must not
// delete the entry a later incarnation wrote under the same key.
#[tokio::test]
async fn an_index_removal_never_deletes_a_later_incarnations_entry() {
    let env = Fleet::start().await;
    let idx = active(&env).await;
    let mut rec = leasehold::JobRecord {
        id: "reborn".into(),
        kind: "sleep".into(),
        status: "queued".into(),
        next_run_at: Some("2026-01-01T00:00:00Z".into()),
        epoch: 2,
        ..Default::default()
    };
    let key = Key::Wait {
        job: "reborn".into(),
    };
    idx.put(&key, &rec).await.unwrap();
    // Someone who knew the job at epoch 1 leaves epoch 2's entry alone.
    idx.remove(&key, leasehold_testkit::doors::index::Remover::Epoch(1))
        .await
        .unwrap();
    assert_eq!(idx.keys_of("reborn").await.unwrap(), vec![key.clone()]);
    // `sync` of a stale state removes only what that state may remove.
    rec.epoch = 1;
    rec.status = "running".into();
    rec.worker_id = Some("w".into());
    idx.sync(&rec, Some(&key)).await.unwrap();
    let mut keys = idx.keys_of("reborn").await.unwrap();
    keys.sort();
    assert!(keys.contains(&key), "epoch 2's entry kept: {keys:?}");
    // Who knows epoch 2 (or does not care) removes it.
    idx.remove(&key, leasehold_testkit::doors::index::Remover::Epoch(2))
        .await
        .unwrap();
    assert!(!idx.keys_of("reborn").await.unwrap().contains(&key));
    // Removing what is not there is no error.
    idx.remove(&key, leasehold_testkit::doors::index::Remover::Anyone)
        .await
        .unwrap();
}

// Issue 30, G4: a worker whose connection was down for a moment (its NATS
// node restarting, a route flapping) lost every job: the reaper's probe
// ended its session after two "no responders" half a second apart, and the
// watcher's ping, made while the worker was still reconnecting, said
// "gone". A key a probe ended is now unknown for a settle time unless the
// process answers, so the worker comes back to its own jobs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_cut_off_for_a_moment_keeps_its_jobs() {
    let env = default_env().await;
    let proxy = FaultProxy::start(&env.url()).await;
    // The default session timeout (10 s): only the probe can end it inside
    // the outage.
    let a = env.worker_proc(
        &["--worker-id", "blink"],
        &[
            ("NATS_URL", proxy.url()),
            ("LH_SESSION_TIMEOUT", "10s".into()),
        ],
    );
    wait_log(&a, "worker starting", Duration::from_secs(10)).await;
    let r = env.reaper().await;
    env.submit("sleep", json!({"input": {"ms": 30000}}), "blinker")
        .await;
    env.wait_for("blinker", Duration::from_secs(15), |r| {
        r.status == "running" && r.worker_id.as_deref() == Some("blink")
    })
    .await;
    env.wait_indexed("blinker", Duration::from_secs(10)).await;
    // A second worker that would take the job if it were re-offered.
    let (b, stop_b) = env.worker().await;
    let ended_before =
        r.0.stats
            .sessions_ended_fast
            .load(std::sync::atomic::Ordering::Relaxed);
    proxy.refuse_new(true);
    proxy.cut();
    // Long enough for the probe to end the session (two misses 0.5 s apart).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while r
        .0
        .stats
        .sessions_ended_fast
        .load(std::sync::atomic::Ordering::Relaxed)
        == ended_before
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the probe never ended the session of the cut-off worker"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    proxy.refuse_new(false);
    // Back: it writes its session again (same incarnation) and keeps its job.
    wait_log(
        &a,
        "writing it again and re-checking every job",
        Duration::from_secs(20),
    )
    .await;
    // Past every look the watcher and the sweep take at the end.
    tokio::time::sleep(Duration::from_secs(8)).await;
    let rec = env.record("blinker").await.unwrap();
    assert_eq!(
        (
            rec.status.as_str(),
            rec.worker_id.as_deref(),
            rec.epoch,
            rec.stale_reclaims
        ),
        ("running", Some("blink"), 1, 0),
        "{rec:?}"
    );
    let recovered = env
        .events_of("blinker")
        .await
        .into_iter()
        .filter(|e| e.data_map().get("recovered").is_some())
        .count();
    assert_eq!(recovered, 0, "the job was re-offered");
    stop_b.cancel();
    b.wait().await.unwrap();
    r.1.cancel();
    r.0.wait().await.unwrap();
}
