//! The promise on busy fleets: a crash strands no bystander, a poison job
//! dies within its bound, a waiting job is never dead-lettered for how
//! often its ticket was delivered, and recovery without a reaper leaves no
//! job behind. Real worker processes killed -9 at the moment that matters.

use std::time::{Duration, Instant, SystemTime};

use leasehold_harness::FaultProxy;
use leasehold_testkit::record::JobSpec;
use leasehold_testkit::SetupOptions;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use leasehold_testkit::{wait_log, Fleet, SESSION};

async fn reaper(env: &Fleet, max_stale_reclaims: u32) -> CancellationToken {
    let mut o = env.reaper_opts();
    o.max_stale_reclaims = max_stale_reclaims;
    env.reaper_with(o).await.1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill9_on_a_busy_fleet_runs_its_jobs_again_at_once_wherever_a_slot_is_free() {
    let env = Fleet::start().await;
    let stop_reaper = reaper(&env, 3).await;
    // A is full with three 4 s jobs.
    let mut a = env.worker_proc(
        &["--worker-id", "busy-a"],
        &[("LH_CONCURRENCY", "3".into()), ("LH_KINDS", "sleep".into())],
    );
    wait_log(&a, "worker starting", Duration::from_secs(10)).await;
    let victims = ["bz-1", "bz-2", "bz-3"];
    for id in victims {
        env.submit("sleep", json!({"input": {"ms": 4000}}), id)
            .await;
    }
    for id in victims {
        env.wait_for(id, Duration::from_secs(15), |r| {
            r.status == "running" && r.worker_id.as_deref() == Some("busy-a")
        })
        .await;
        env.wait_indexed(id, Duration::from_secs(10)).await;
    }
    // B and C each run a long job: no worker of the fleet is idle.
    let mut o = env.opts();
    o.concurrency = 3;
    let (b, stop_b) = env.worker_with(o.clone()).await;
    env.submit("sleep", json!({"input": {"ms": 60000}}), "long-b")
        .await;
    env.wait_for("long-b", Duration::from_secs(10), |r| {
        r.status == "running" && r.worker_id.as_deref() == Some(b.worker_id.as_str())
    })
    .await;
    let (c, stop_c) = env.worker_with(o).await;
    env.submit("sleep", json!({"input": {"ms": 60000}}), "long-c")
        .await;
    env.wait_status("long-c", "running", Duration::from_secs(10))
        .await;

    a.kill9();
    let killed = Instant::now();
    let fleet = [b.worker_id.clone(), c.worker_id.clone()];
    for id in victims {
        let r = env
            .wait_for(id, Duration::from_secs(20), |r| {
                r.epoch == 2 && r.status == "running"
            })
            .await;
        let took = killed.elapsed();
        assert!(
            fleet.contains(r.worker_id.as_ref().unwrap()),
            "{id} runs on {:?}",
            r.worker_id
        );
        // Each bystander runs again within the session timeout plus the
        // recovery's own round trips; before, only a worker with every
        // slot free took it, one after the other (4 s each).
        assert!(
            took < SESSION + Duration::from_secs(3),
            "{id} ran again {took:?} after the kill"
        );
        assert_eq!(r.stale_reclaims, 1);
    }
    for id in victims {
        let done = env
            .wait_status(id, "completed", Duration::from_secs(20))
            .await;
        assert_eq!(done.epoch, 2, "{id} ran exactly once more");
    }
    // The long jobs were never disturbed.
    for id in ["long-b", "long-c"] {
        let r = env.record(id).await.unwrap();
        assert_eq!(
            (r.status.as_str(), r.epoch, r.stale_reclaims),
            ("running", 1, 0)
        );
    }
    stop_reaper.cancel();
    stop_b.cancel();
    stop_c.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_job_is_dead_within_its_bound_and_takes_no_healthy_job_with_it() {
    let env = Fleet::start().await;
    let max = 2;
    let stop_r1 = reaper(&env, max).await;
    let stop_r2 = reaper(&env, max).await;
    let extra = [
        ("LH_CONCURRENCY", "2".into()),
        ("LH_MAX_STALE_RECLAIMS", max.to_string()),
    ];
    // It crashes at each of its max + 1 claims. As a suspect it is indexed
    // before it runs, so the end of the last session dead-letters it
    // although no worker is left to take its ticket.
    let mut workers: Vec<_> = (0..=max)
        .map(|i| env.worker_proc(&["--worker-id", &format!("pz-{i}")], &extra))
        .collect();
    for w in &workers {
        wait_log(w, "worker starting", Duration::from_secs(10)).await;
    }
    let t0 = Instant::now();
    env.submit("crash", json!({"input": {}}), "poison-1").await;
    let dead = env
        .wait_status("poison-1", "dead", Duration::from_secs(40))
        .await;
    let took = t0.elapsed();
    assert_eq!(dead.error.as_ref().unwrap().class, "poison", "{dead:?}");
    // (max stale reclaims + 1) crashes, each recovered within a session
    // timeout and a second, plus start-up slack for a loaded machine.
    let bound = (SESSION + Duration::from_secs(1)) * (max + 1) + Duration::from_secs(6);
    assert!(took < bound, "dead after {took:?} (bound {bound:?})");
    // The fleet it left behind still runs healthy work, none of it dead.
    for w in &mut workers {
        w.kill9();
    }
    let (_w, stop) = env.worker().await;
    env.submit("echo", json!({"input": {"after": true}}), "healthy")
        .await;
    env.wait_status("healthy", "completed", Duration::from_secs(15))
        .await;
    stop.cancel();
    stop_r1.cancel();
    stop_r2.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_suspect_is_never_dead_lettered_for_its_deliveries() {
    // Three deliveries at most per ticket, so waiting spends them fast.
    let env = Fleet::with(SetupOptions {
        ack_wait: Duration::from_secs(1),
        max_deliver: 3,
        ..SetupOptions::default()
    })
    .await;
    let stop_reaper = reaper(&env, 3).await;
    // Two suspects (each lost two workers before): one worker runs one
    // suspect at a time, so the second waits, its ticket NAKed each second.
    for (id, ms) in [("sus-1", 6000), ("sus-2", 10)] {
        let mut rec = leasehold_testkit::record::new_record(
            id,
            "sleep",
            JobSpec {
                id: Some(id.into()),
                input: json!({"ms": ms}).to_string(),
                ..Default::default()
            },
            0,
            SystemTime::now(),
        );
        rec.stale_reclaims = 2;
        env.jobs.create(&rec).await.unwrap();
    }
    let (_w, stop) = env.worker().await;
    env.submit("sleep", json!({"input": {"ms": 6000}}), "sus-1")
        .await;
    env.wait_status("sus-1", "running", Duration::from_secs(10))
        .await;
    env.submit("sleep", json!({"input": {"ms": 10}}), "sus-2")
        .await;
    let done = env
        .wait_for("sus-2", Duration::from_secs(40), |r| {
            matches!(r.status.as_str(), "completed" | "dead")
        })
        .await;
    assert_eq!(done.status, "completed", "{done:?}");
    // It waited for the first suspect, past its ticket's max deliveries.
    let first = env
        .wait_status("sus-1", "completed", Duration::from_secs(10))
        .await;
    assert_eq!((first.epoch, done.epoch), (1, 1));
    let replaced = env.events_of("sus-2").await.into_iter().any(|e| {
        e.r#type == "progress"
            && e.data_map().get("reason").and_then(|v| v.as_str())
                == Some("its ticket reached max deliveries")
    });
    assert!(replaced, "the ticket past max deliveries was replaced");
    stop.cancel();
    stop_reaper.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_end_is_acked_only_when_every_job_of_it_was_recovered() {
    let env = Fleet::start().await;
    let mut a = env.worker_proc(&["--worker-id", "end-a"], &[]);
    wait_log(&a, "worker starting", Duration::from_secs(10)).await;
    env.submit("sleep", json!({"input": {"ms": 3000}}), "end-1")
        .await;
    env.wait_for("end-1", Duration::from_secs(15), |r| {
        r.status == "running" && r.worker_id.as_deref() == Some("end-a")
    })
    .await;
    env.wait_indexed("end-1", Duration::from_secs(10)).await;
    // B, the only recoverer (no reaper), cannot publish the re-offer's
    // ticket at first: its recovery of the job fails.
    let proxy = FaultProxy::start(&env.url()).await;
    let ticket = format!("{}.submit.sleep", env.prefix);
    proxy.drop_matching(&ticket);
    let mut o = env.opts();
    o.nats = leasehold_testkit::doors::layout::NatsArgs::local(proxy.url(), &env.prefix);
    let (b, stop) = env.worker_with(o).await;
    a.kill9();
    // The ended session's re-offer was tried (and its ticket dropped).
    let deadline = Instant::now() + Duration::from_secs(20);
    while proxy.published(&ticket) == 0 {
        assert!(Instant::now() < deadline, "no re-offer was tried");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    proxy.clear();
    // The end was not acked: it comes back and the job is recovered.
    let moved = env
        .wait_for("end-1", Duration::from_secs(30), |r| {
            r.worker_id.as_deref() == Some(b.worker_id.as_str())
        })
        .await;
    assert_eq!((moved.epoch, moved.stale_reclaims), (2, 1));
    env.wait_status("end-1", "completed", Duration::from_secs(20))
        .await;
    stop.cancel();
}
