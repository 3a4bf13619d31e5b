//! Regressions found by `leasehold-soak` (`make soak`): each reproduces,
//! with real processes and the fault proxy at the exact moment, a failure a
//! seeded soak run reported. The seed and the run that found it are named
//! on each test.

use std::time::Duration;

use leasehold_harness::FaultProxy;
use leasehold_testkit::SetupOptions;
use serde_json::json;

use leasehold_testkit::{wait_log, Fleet};

/// Found by `leasehold-soak --seed 8 --cluster --seconds 60`: a `fail` job
/// whose attempt failed while a node was being killed stayed `running` for
/// 30 s with its owner alive and nothing running it. A failed attempt
/// publishes the retry's ticket before it writes `queued`; when that
/// publish fails (a node restarting, a leader election), the attempt ends
/// with the record still `running` under a live session, "for the
/// session's end to recover". A session that never ends never recovers
/// it: once the job was indexed its ticket was settled, so no ticket comes
/// back to ask the owner either, and only the attempt deadline (6 h by
/// default) would free it.
#[tokio::test]
async fn a_retry_whose_ticket_cannot_be_published_does_not_leave_the_job_running() {
    let env = Fleet::with(SetupOptions::default()).await;
    let proxy = FaultProxy::start(&env.url()).await;
    let a = env.worker_proc(&["--worker-id", "retry-a"], &[("NATS_URL", proxy.url())]);
    wait_log(&a, "worker starting", Duration::from_secs(10)).await;
    // Runs 2 s, so it is indexed (and its ticket settled) before it fails.
    env.submit(
        "fail",
        json!({"input": {"class": "retryable", "times": 1, "ms": 2000}}),
        "retry-lost",
    )
    .await;
    env.wait_indexed("retry-lost", Duration::from_secs(10))
        .await;
    // The retry's fresh ticket never reaches the server.
    proxy.drop_matching(&format!("{}.submit.fail", env.prefix));
    wait_log(
        &a,
        "cannot publish the retry's ticket",
        Duration::from_secs(40),
    )
    .await;
    proxy.clear();
    // Everything a recovery could need is there: the owner (alive and well
    // connected), a second worker, a reaper.
    let r = env.reaper().await;
    let (b, stop) = env.worker().await;
    let done = env
        .wait_status("retry-lost", "completed", Duration::from_secs(60))
        .await;
    assert_eq!(done.attempts, 1, "one failed attempt, then the retry");
    r.1.cancel();
    r.0.wait().await.unwrap();
    stop.cancel();
    b.wait().await.unwrap();
}

/// Found by `leasehold-soak --seed 630518508 --cluster --minutes 30`: a
/// worker given SIGTERM three seconds after a node restart never finished
/// its shutdown ("shutdown: stop pulling; draining in-flight jobs for up to
/// 2s", then nothing for 30 s until it was killed). A pull loop that got a
/// ticket tops up with `fetch()`, which sets no expiry: when its request or
/// the server's answer is lost (the connection drops, the consumer's
/// leader moves), nothing ever ends that fetch. The loop waits for ever,
/// holding every slot it reserved for the top-up, so the worker stops
/// taking tickets of that kind, runs fewer of any other, and its shutdown
/// waits for the loop.
///
/// Reproduced exactly: the worker's pull requests pass through the proxy
/// with a delay (and, the proxy keeping order, everything it sends after
/// one), so the top-up fetch sent the moment a ticket is delivered is still
/// in the proxy when the connection is cut; the client reconnects at once.
#[tokio::test]
async fn a_top_up_fetch_lost_with_its_connection_does_not_stall_the_worker() {
    let env = Fleet::with(SetupOptions::default()).await;
    let proxy = FaultProxy::start(&env.url()).await;
    let mut a = env.worker_proc(&["--worker-id", "fetch-a"], &[("NATS_URL", proxy.url())]);
    wait_log(&a, "worker starting", Duration::from_secs(10)).await;
    proxy.delay("$JS.API.CONSUMER.MSG.NEXT.>", Duration::from_secs(3));
    env.submit("sleep", json!({"input": {"ms": 100}}), "first")
        .await;
    // The ticket is delivered (the server's side of the proxy is not
    // delayed): the worker's top-up fetch follows at once, into the delay.
    let mut sleep_consumer = env.work.consumer("sleep").await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while sleep_consumer.info().await.unwrap().num_ack_pending == 0 {
        assert!(tokio::time::Instant::now() < deadline, "never delivered");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    proxy.cut();
    proxy.clear();
    // The worker is back: another kind's loop serves an echo job.
    env.submit("echo", json!({"input": {}}), "alive").await;
    env.wait_status("alive", "completed", Duration::from_secs(30))
        .await;
    // And its sleep loop must be too.
    for i in 0..3 {
        env.submit(
            "sleep",
            json!({"input": {"ms": 100}}),
            &format!("after-{i}"),
        )
        .await;
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    for i in 0..3 {
        let id = format!("after-{i}");
        loop {
            let r = env.jobs.get(&id).await.unwrap().map(|v| v.value.status);
            if r.as_deref() == Some("completed") {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{id} not run in 60 s (record: {r:?}); the worker:\n{}",
                a.output()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    // And it shuts down within its drain and hand-back time.
    a.term();
    let (st, a) = tokio::task::spawn_blocking(move || {
        let st = a.wait_timeout(Duration::from_secs(30));
        (st, a)
    })
    .await
    .unwrap();
    assert!(
        st.is_some_and(|s| s.success()),
        "no clean exit 30 s after SIGTERM ({st:?}):\n{}",
        a.output()
    );
}

/// Found by `make bench` (part `timers`, 10,000 sleeping jobs on one
/// worker, run after the `research` part): three jobs failed with
/// "maximum consumers limit reached (10026)" while their attempts read
/// their steps, each read's short-lived consumer among hundreds at once,
/// and spent the job's whole retry budget in a second. A read now waits
/// for room under the limit in place. Here the index's stream allows one
/// consumer, held by someone else for 600 ms: a listing of the index waits
/// for it to go and reads the entry, instead of failing.
#[tokio::test]
async fn a_read_waits_for_room_under_the_servers_consumer_limit() {
    use async_nats::jetstream::{consumer, stream};
    use leasehold_testkit::doors::index::{Active, Filter};
    use leasehold_testkit::doors::layout::NatsArgs;
    let server = leasehold_harness::NatsServer::start();
    leasehold_harness::wait_for_jetstream(&server.url(), Duration::from_secs(10)).await;
    let conn = NatsArgs::local(server.url(), "lh")
        .connect("test")
        .await
        .unwrap();
    let s = conn
        .js
        .create_stream(stream::Config {
            name: "KV_lh_active".into(),
            subjects: vec!["$KV.lh_active.>".into()],
            max_messages_per_subject: 1,
            allow_direct: true,
            max_consumers: 1,
            ..Default::default()
        })
        .await
        .unwrap();
    let active = Active::open(&conn).await.unwrap();
    active
        .kv()
        .put(
            "wait.j1",
            serde_json::to_vec(&json!({"job": "j1", "kind": "echo", "status": "queued"}))
                .unwrap()
                .into(),
        )
        .await
        .unwrap();
    s.create_consumer(consumer::pull::Config {
        durable_name: Some("holder".into()),
        ..Default::default()
    })
    .await
    .unwrap();
    // The limit is real: a second consumer is refused.
    assert!(s
        .create_consumer(consumer::pull::Config::default())
        .await
        .is_err());
    let js = conn.js.clone();
    let freed = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(600)).await;
        js.delete_consumer_from_stream("holder", "KV_lh_active")
            .await
            .unwrap();
    });
    let t0 = std::time::Instant::now();
    let listed = active
        .list(Filter::All)
        .await
        .expect("the read waited for room");
    assert_eq!(listed.len(), 1);
    assert!(
        t0.elapsed() >= Duration::from_millis(500),
        "it waited: {:?}",
        t0.elapsed()
    );
    freed.await.unwrap();
}
