//! The promise under time: cancellation never undone, a live job never
//! dead-lettered, no attempt left half-way, nothing stranded, with real
//! processes paused, killed and cut off at the moments that matter.

use std::time::{Duration, SystemTime};

use async_nats::jetstream::AckKind;
use futures::StreamExt;
use leasehold_harness::{bin_path, FaultProxy};
use leasehold_testkit::doors::engine::{End, Handler, JobCtx, Worker};
use leasehold_testkit::doors::index::Filter;
use leasehold_testkit::doors::owner::machine;
use leasehold_testkit::doors::reaper::Handle;
use leasehold_testkit::record::JobSpec;
use leasehold_testkit::SetupOptions;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use leasehold_testkit::{wait_log, Fleet, ACK_WAIT};

/// Sets `cancel_requested` straight in the record, as a request whose
/// notification never reached the owner (or came from an older binary).
async fn request_cancel_quietly(env: &Fleet, id: &str) {
    env.jobs
        .transition(id, |r| {
            match machine::request_cancel(r, SystemTime::now())? {
                machine::CancelOutcome::Requested(n) | machine::CancelOutcome::Cancelled(n) => {
                    Ok(Some(n))
                }
                machine::CancelOutcome::AlreadyRequested | machine::CancelOutcome::Unchanged(_) => {
                    Ok(None)
                }
            }
        })
        .await
        .unwrap();
}

async fn start_reaper(env: &Fleet) -> (Handle, CancellationToken) {
    let mut o = env.reaper_opts();
    o.stranded_grace = Duration::from_millis(1500);
    env.reaper_with(o).await
}

async fn letters(env: &Fleet, id: &str) -> usize {
    env.letters_of(id).await.len()
}

#[tokio::test]
async fn a_cancel_request_is_never_undone_by_a_retry_a_hand_back_or_a_reclaim() {
    let env = Fleet::start().await;
    // A retry: the request lands while the attempt runs; the attempt then
    // fails with a retryable error, and the requeue cancels instead.
    let (w, stop) = env.worker().await;
    env.submit(
        "fail",
        json!({"input": {"class": "retryable", "times": 5, "ms": 1500}}),
        "c-retry",
    )
    .await;
    env.wait_status("c-retry", "running", Duration::from_secs(10))
        .await;
    request_cancel_quietly(&env, "c-retry").await;
    let r = env
        .wait_for("c-retry", Duration::from_secs(15), |r| {
            r.status != "running"
        })
        .await;
    assert_eq!(
        r.status, "cancelled",
        "a retry never undoes a cancel: {r:?}"
    );
    stop.cancel();
    w.wait().await.unwrap();

    // A hand-back at shutdown honours the pending request.
    let mut a = env.worker_proc(&[], &[]);
    env.submit("sleep", json!({"input": {"ms": 30000}}), "c-handback")
        .await;
    env.wait_status("c-handback", "running", Duration::from_secs(10))
        .await;
    request_cancel_quietly(&env, "c-handback").await;
    a.term();
    let r = env
        .wait_for("c-handback", Duration::from_secs(15), |r| {
            r.status != "running"
        })
        .await;
    assert_eq!(r.status, "cancelled", "a hand-back never undoes a cancel");
    assert!(a.wait_timeout(Duration::from_secs(10)).is_some());

    // A reclaim after the owner died honours it too (re-offer path).
    let mut a = env.worker_proc(&[], &[]);
    env.submit("sleep", json!({"input": {"ms": 30000}}), "c-reclaim")
        .await;
    env.wait_status("c-reclaim", "running", Duration::from_secs(10))
        .await;
    env.wait_indexed("c-reclaim", Duration::from_secs(10)).await;
    request_cancel_quietly(&env, "c-reclaim").await;
    a.kill9();
    let (b, stop) = env.worker().await;
    let r = env
        .wait_for("c-reclaim", Duration::from_secs(20), |r| {
            r.status != "running"
        })
        .await;
    assert_eq!(r.status, "cancelled", "a reclaim never undoes a cancel");
    assert_eq!(r.epoch, 1, "the job never ran again");
    // And a claim of a waiting job with a pending request cancels it.
    let mut q = machine::new_record(
        "c-claim",
        "echo",
        JobSpec {
            input: "{}".into(),
            ..Default::default()
        },
        0,
        SystemTime::now(),
    );
    q.cancel_requested = true;
    q.next_run_at = Some(leasehold_testkit::record::now());
    env.seed_record(&q).await;
    env.work.reissue(&q, "test", "1").await.unwrap();
    let r = env
        .wait_for("c-claim", Duration::from_secs(10), |r| r.status != "queued")
        .await;
    assert_eq!((r.status.as_str(), r.epoch), ("cancelled", 0));
    stop.cancel();
    b.wait().await.unwrap();
}

#[tokio::test]
async fn a_long_job_restarted_under_its_identity_is_never_killed_by_max_deliveries() {
    let env = Fleet::with(SetupOptions {
        ack_wait: ACK_WAIT,
        max_deliver: 3,
        ..SetupOptions::default()
    })
    .await;
    let r = start_reaper(&env).await;
    let extra = [("LH_SESSION_TIMEOUT", "3s".into())];
    let mut a = env.worker_proc(&["--worker-id", "pod-md"], &extra);
    env.submit("sleep", json!({"input": {"ms": 6000}}), "long-md")
        .await;
    env.wait_status("long-md", "running", Duration::from_secs(10))
        .await;
    a.kill9();
    let _a2 = env.worker_proc(&["--worker-id", "pod-md"], &extra);
    // A second copy of the ticket (a resubmission after the dedupe window)
    // reaches the fleet while the job runs: it is settled, not NAKed.
    let rec = env
        .wait_for("long-md", Duration::from_secs(20), |r| r.epoch == 2)
        .await;
    env.work.reissue(&rec, "duplicate", "1").await.unwrap();
    let done = env
        .wait_status("long-md", "completed", Duration::from_secs(30))
        .await;
    assert_eq!(done.worker_id.as_deref(), Some("pod-md"));
    assert_eq!(letters(&env, "long-md").await, 0, "never dead-lettered");
    assert_eq!(
        r.0.stats
            .max_deliveries
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    r.1.cancel();
    r.0.wait().await.unwrap();
}

/// A handler whose result is not JSON (it would make the record unwritable).
struct BadOutput;

#[async_trait::async_trait]
impl Handler for BadOutput {
    async fn run(&self, _: JobCtx) -> End {
        End::Completed(leasehold_proto::JobResult {
            output: "not json {".into(),
            ..Default::default()
        })
    }
}

/// A handler that panics.
struct Panics;

#[async_trait::async_trait]
impl Handler for Panics {
    async fn run(&self, _: JobCtx) -> End {
        panic!("boom")
    }
}

#[tokio::test]
async fn no_failure_inside_an_attempt_leaves_the_job_held_by_a_live_worker() {
    let env = Fleet::start().await;
    let stop = CancellationToken::new();
    let w = Worker::new(env.opts())
        .with_handler("echo", std::sync::Arc::new(BadOutput))
        .with_handler("sleep", std::sync::Arc::new(Panics))
        .start(stop.clone())
        .await
        .unwrap();
    env.submit("echo", json!({"input": {}}), "bad-output").await;
    let r = env
        .wait_status("bad-output", "failed", Duration::from_secs(10))
        .await;
    assert!(
        r.error.as_ref().unwrap().message.contains("not JSON"),
        "{r:?}"
    );
    env.submit(
        "sleep",
        json!({"input": {"ms": 1}, "retry": {"max_attempts": 2}}),
        "panics",
    )
    .await;
    let r = env
        .wait_status("panics", "failed", Duration::from_secs(15))
        .await;
    assert!(
        r.error.as_ref().unwrap().message.contains("panicked"),
        "{r:?}"
    );
    assert_eq!(
        r.attempts, 2,
        "each panic ended its attempt: retried, then failed"
    );
    // A ticket reusing the id of a job of another kind is dead-lettered,
    // and the job it names is never run under a handler not its own.
    let mut other = machine::new_record(
        "reused",
        "research",
        JobSpec::default(),
        0,
        SystemTime::now(),
    );
    other.status = "running".into();
    other.worker_id = Some("gone".into());
    other.session = Some("gone".into());
    other.epoch = 1;
    env.seed_record(&other).await;
    env.submit("echo", json!({"input": {}}), "reused").await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while letters(&env, "reused").await == 0 {
        assert!(tokio::time::Instant::now() < deadline, "no dead letter");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let after = env.record("reused").await.unwrap();
    assert_eq!((after.kind.as_str(), after.epoch), ("research", 1));
    stop.cancel();
    w.wait().await.unwrap();
}

#[tokio::test]
async fn a_ticket_past_max_deliveries_whose_advisory_was_lost_is_replaced() {
    let env = Fleet::with(SetupOptions {
        ack_wait: ACK_WAIT,
        max_deliver: 2,
        ..SetupOptions::default()
    })
    .await;
    // A waiting job (its record says so, its index lists it) and its ticket.
    let p = env
        .ticket("echo", json!({"input": {"n": 1}}), "lost-adv")
        .await;
    let mut q = machine::new_record(
        "lost-adv",
        "echo",
        JobSpec {
            input: json!({"n": 1}).to_string(),
            ..Default::default()
        },
        p,
        SystemTime::now(),
    );
    q.next_run_at = Some(leasehold_testkit::record::now());
    env.seed_record(&q).await;
    // Something NAKs it until the server gives up on it (it notices at the
    // next delivery attempt, so keep pulling until the advisory is out)...
    let consumer = env.work.consumer("echo").await.unwrap();
    let mut adv = env
        .conn
        .js
        .get_stream(env.conn.layout.advisory_stream())
        .await
        .unwrap();
    let mut naks = 0;
    while adv.info().await.unwrap().state.messages == 0 {
        let mut b = consumer
            .batch()
            .max_messages(1)
            .expires(Duration::from_millis(500))
            .messages()
            .await
            .unwrap();
        while let Some(Ok(m)) = b.next().await {
            m.ack_with(AckKind::Nak(None)).await.unwrap();
            naks += 1;
        }
        assert!(naks <= 2, "delivered past max_deliver");
    }
    // ...and its advisory is lost before any reaper sees it.
    env.conn
        .js
        .get_stream(env.conn.layout.advisory_stream())
        .await
        .unwrap()
        .purge()
        .await
        .unwrap();
    assert!(
        env.work.get(p).await.unwrap().is_some(),
        "the ticket stays, never delivered again"
    );
    let r = start_reaper(&env).await;
    let (w, stop) = env.worker().await;
    let done = env
        .wait_status("lost-adv", "completed", Duration::from_secs(20))
        .await;
    assert!(done.ticket_seq > p, "it ran on a fresh ticket");
    assert!(
        env.work.get(p).await.unwrap().is_none(),
        "the stuck ticket is gone"
    );
    stop.cancel();
    w.wait().await.unwrap();
    r.1.cancel();
    r.0.wait().await.unwrap();
}

#[tokio::test]
async fn a_job_may_retry_more_often_than_one_ticket_may_be_delivered() {
    let env = Fleet::with(SetupOptions {
        ack_wait: ACK_WAIT,
        max_deliver: 3,
        ..SetupOptions::default()
    })
    .await;
    let r = start_reaper(&env).await;
    let (w, stop) = env.worker().await;
    env.submit(
        "fail",
        json!({"input": {"class": "retryable", "times": 6}, "retry": {"max_attempts": 8, "base_ms": 10, "cap_ms": 50}}),
        "many-retries",
    )
    .await;
    let done = env
        .wait_status("many-retries", "completed", Duration::from_secs(30))
        .await;
    assert_eq!(done.attempts, 6, "six failed attempts, then success");
    assert_eq!(letters(&env, "many-retries").await, 0);
    stop.cancel();
    w.wait().await.unwrap();
    r.1.cancel();
    r.0.wait().await.unwrap();
}

#[tokio::test]
async fn an_unreadable_record_is_skipped_and_reported_never_stopping_recovery() {
    let env = Fleet::start().await;
    // A running job of a gone worker, indexed, and beside it a record that
    // does not decode, also indexed as that worker's.
    let mut good = machine::new_record(
        "good",
        "echo",
        JobSpec {
            input: "{}".into(),
            ..Default::default()
        },
        0,
        SystemTime::now(),
    );
    good.status = "running".into();
    good.worker_id = Some("gone".into());
    good.session = Some("s".into());
    good.epoch = 1;
    env.seed_record(&good).await;
    let mut bad = good.clone();
    bad.id = "garbled".into();
    env.active()
        .await
        .put(
            &leasehold_testkit::doors::index::Key::Run {
                worker: "gone".into(),
                job: "garbled".into(),
            },
            &bad,
        )
        .await
        .unwrap();
    env.jobs
        .kv()
        .put("garbled", "{not a record".into())
        .await
        .unwrap();
    let r = start_reaper(&env).await;
    let (w, stop) = env.worker().await;
    env.wait_status("good", "completed", Duration::from_secs(20))
        .await;
    let out = tokio::process::Command::new(bin_path("leasehold"))
        .args(["list", "--all", "--corrupt"])
        .env("NATS_URL", env.url())
        .output()
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("garbled"), "{text}");
    assert_eq!(
        out.status.code(),
        Some(1),
        "unreadable records make the listing fail"
    );
    stop.cancel();
    w.wait().await.unwrap();
    r.1.cancel();
    r.0.wait().await.unwrap();
}

// The fault proxy runs in this test's runtime: it needs threads of
// its own while the test body blocks (e.g. waiting on a process).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_a_claim_in_flight_hands_the_job_back_at_once() {
    let env = Fleet::start().await;
    let proxy = FaultProxy::start(&env.url()).await;
    let mut a = env.worker_proc(
        &[],
        &[
            ("NATS_URL", proxy.url()),
            ("LH_SESSION_TIMEOUT", "60s".into()),
            ("LH_DRAIN_TIMEOUT", "0s".into()),
        ],
    );
    wait_log(&a, "worker starting", Duration::from_secs(10)).await;
    // The claim write is slowed down; SIGTERM arrives while it is in flight.
    let claims = format!("$KV.{}.>", env.conn.layout.jobs_bucket());
    proxy.delay(&claims, Duration::from_millis(600));
    env.submit("sleep", json!({"input": {"ms": 1000}}), "in-flight")
        .await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while proxy.published(&claims) == 0 {
        assert!(tokio::time::Instant::now() < deadline, "no claim write");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    a.term();
    tokio::time::sleep(Duration::from_millis(700)).await;
    proxy.clear();
    // The claim lands after the shutdown began: the worker waits for it and
    // hands the job back, instead of leaving it to its session's end.
    let r = env
        .wait_for("in-flight", Duration::from_secs(10), |r| {
            r.status == "queued"
        })
        .await;
    assert_eq!(
        (r.epoch, r.stale_reclaims),
        (1, 0),
        "a hand-back, not a reclaim"
    );
    let status = a
        .wait_timeout(Duration::from_secs(10))
        .unwrap_or_else(|| panic!("the worker did not exit:\n{}", a.output()));
    assert!(status.success(), "{}", a.output());
    assert!(
        !a.output().contains("timed out"),
        "every write after the claim was answered: {}",
        a.output()
    );
    let (b, stop) = env.worker().await;
    let done = env
        .wait_status("in-flight", "completed", Duration::from_secs(10))
        .await;
    assert_eq!(done.stale_reclaims, 0);
    stop.cancel();
    b.wait().await.unwrap();
}

// The fault proxy runs in this test's runtime: it needs threads of
// its own while the test body blocks (e.g. waiting on a process).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_whose_reply_was_lost_is_recognised_by_its_own_token() {
    let env = Fleet::start().await;
    let proxy = FaultProxy::start(&env.url()).await;
    let a = env.worker_proc(
        &[],
        &[
            ("NATS_URL", proxy.url()),
            ("LH_SESSION_TIMEOUT", "60s".into()),
        ],
    );
    wait_log(&a, "worker starting", Duration::from_secs(10)).await;
    let hold = proxy.hold(&format!("$KV.{}.>", env.conn.layout.jobs_bucket()));
    env.submit("sleep", json!({"input": {"ms": 500}}), "lost-reply")
        .await;
    hold.triggered().await;
    let t0 = tokio::time::Instant::now();
    // The claim reaches the server; its reply does not reach the worker.
    proxy.mute_replies(true);
    proxy.release_all();
    env.wait_status("lost-reply", "running", Duration::from_secs(10))
        .await;
    // Past the publish's 5 s timeout, replies flow again.
    tokio::time::sleep(Duration::from_secs(6)).await;
    proxy.mute_replies(false);
    let done = env
        .wait_status("lost-reply", "completed", Duration::from_secs(20))
        .await;
    assert!(
        t0.elapsed() > Duration::from_secs(5),
        "the claim's reply was withheld past the publish timeout"
    );
    assert_eq!(
        (done.epoch, done.stale_reclaims),
        (1, 0),
        "the worker adopted its own claim; nobody reclaimed it"
    );
    drop(a);
}

// The fault proxy runs in this test's runtime: it needs threads of
// its own while the test body blocks (e.g. waiting on a process).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_reclaim_and_the_old_ticket_claim_a_job_once() {
    let env = Fleet::start().await;
    let proxy = FaultProxy::start(&env.url()).await;
    let extra = [
        ("NATS_URL", proxy.url()),
        ("LH_SESSION_TIMEOUT", "60s".into()),
        // Time for the test to arm its hold between the claim's wake-up
        // NAK and the index write's ack (the same ack subject).
        ("LH_INDEX_AFTER", "3s".into()),
    ];
    let mut a = env.worker_proc(&["--worker-id", "pod-twice"], &extra);
    wait_log(&a, "worker starting", Duration::from_secs(10)).await;
    env.submit("sleep", json!({"input": {"ms": 6000}}), "twice")
        .await;
    env.wait_status("twice", "running", Duration::from_secs(10))
        .await;
    // The claim's NAK (the wake-up) has gone through... (only the work
    // stream's acks: the session-ends consumer acks session writes too)
    let ticket_acks = format!("$JS.ACK.{}.>", env.conn.layout.work_stream());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while proxy.published(&ticket_acks) == 0 {
        assert!(tokio::time::Instant::now() < deadline, "no wake-up NAK");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // ...and the job gets indexed, but its ticket's ack (after the index
    // write) never goes out: the old ticket comes back while a restarted
    // process already runs it.
    let hold = proxy.hold(&ticket_acks);
    env.wait_indexed("twice", Duration::from_secs(10)).await;
    tokio::time::timeout(Duration::from_secs(10), hold.triggered())
        .await
        .expect("the ack after the index write was held");
    a.kill9();
    proxy.clear();
    let a2 = env.worker_proc(
        &["--worker-id", "pod-twice"],
        &[("LH_SESSION_TIMEOUT", "60s".into())],
    );
    let done = env
        .wait_status("twice", "completed", Duration::from_secs(30))
        .await;
    assert_eq!(
        done.epoch, 2,
        "one reclaim: the restart's; the old ticket was settled"
    );
    let claims = env
        .events_of("twice")
        .await
        .iter()
        .filter(|e| e.r#type == "claimed")
        .count();
    assert_eq!(claims, 2);
    drop(a2);
}

#[tokio::test]
async fn a_ticket_refused_for_configuration_skew_parks_its_job_once() {
    let env = Fleet::start().await;
    // A waiting job (backing off) whose ticket a strict worker refuses.
    let big = "x".repeat(200);
    let mut q = machine::new_record(
        "skewed",
        "echo",
        JobSpec {
            input: json!({"text": big}).to_string(),
            ..Default::default()
        },
        0,
        SystemTime::now(),
    );
    q.next_run_at = Some(leasehold_testkit::record::now());
    env.seed_record(&q).await;
    env.work.reissue(&q, "retry", "1").await.unwrap();
    let mut o = env.opts();
    o.max_submission_bytes = 64;
    let (w, stop) = env.worker_with(o).await;
    let r = start_reaper(&env).await;
    let parked = env
        .wait_status("skewed", "parked", Duration::from_secs(10))
        .await;
    assert_eq!(parked.parked_reason.as_deref(), Some("rejected_ticket"));
    // Sweeps go on; the job stays parked, with one dead letter.
    let mut m = r.0.metrics_watch();
    for _ in 0..4 {
        m.changed().await.unwrap();
    }
    assert_eq!(letters(&env, "skewed").await, 1);
    assert_eq!(
        env.active().await.list(Filter::Parked).await.unwrap().len(),
        1
    );
    stop.cancel();
    w.wait().await.unwrap();
    r.1.cancel();
    r.0.wait().await.unwrap();
}

// Issue 18: the owner's terminal write landed but its answer was lost; the
// gate's retry found the job completed and read that as "ownership lost",
// so no terminal event was published: retention, which reads terminal
// events, never found the job (a leak that also blocked its id). The gate
// recognises its own landed write, as the claim does by its token.
// The fault proxy runs in this test's runtime: it needs threads of
// its own while the test body blocks (e.g. waiting on a process).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminal_write_whose_answer_was_lost_is_recognised_as_the_owners() {
    let env = Fleet::start().await;
    let proxy = leasehold_harness::FaultProxy::start(&env.url()).await;
    // No renewal falls inside the muted window below.
    let a = env.worker_proc(
        &["--worker-id", "lost-ack"],
        &[
            ("NATS_URL", proxy.url()),
            ("LH_SESSION_TIMEOUT", "60s".into()),
            ("LH_SESSION_RENEW", "30s".into()),
        ],
    );
    wait_log(&a, "worker starting", Duration::from_secs(10)).await;
    env.submit("sleep", json!({"input": {"ms": 1500}}), "lost-ack-job")
        .await;
    env.wait_status("lost-ack-job", "running", Duration::from_secs(10))
        .await;
    // The next write of the record is the completion: it reaches the
    // server, its answer never comes back.
    let hold = proxy.hold("$KV.lh_jobs.lost-ack-job");
    tokio::time::timeout(Duration::from_secs(10), hold.triggered())
        .await
        .expect("the completion was written");
    proxy.mute_replies(true);
    hold.release();
    env.wait_status("lost-ack-job", "completed", Duration::from_secs(10))
        .await;
    wait_log(&a, "owner write failed; retrying", Duration::from_secs(20)).await;
    proxy.mute_replies(false);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !env
        .events_of("lost-ack-job")
        .await
        .iter()
        .any(|e| e.r#type == "completed")
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no completed event:\n{}",
            a.output()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        !a.output().contains("ownership lost"),
        "its own landed write was not read as a loss:\n{}",
        a.output()
    );
}

/// A handler that parks its job at once.
struct ParksAtOnce;

#[async_trait::async_trait]
impl Handler for ParksAtOnce {
    async fn run(&self, _: JobCtx) -> End {
        End::parked("review", "a person decides")
    }
}

// Issue 18: a job that parked before `--index-after`, with its park entry's
// write failing, was never listed by `review list`: nothing else indexes
// a parked job. Its ticket is now kept until the entry is written.
// The fault proxy runs in this test's runtime: it needs threads of
// its own while the test body blocks (e.g. waiting on a process).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fast_park_whose_index_write_failed_is_listed_all_the_same() {
    let env = Fleet::start().await;
    let proxy = FaultProxy::start(&env.url()).await;
    let mut o = env.opts();
    o.nats.url = proxy.url();
    o.index_after = Duration::from_secs(30);
    let stop = CancellationToken::new();
    let w = Worker::new(o)
        .with_handler("echo", std::sync::Arc::new(ParksAtOnce))
        .start(stop.clone())
        .await
        .unwrap();
    proxy.drop_matching("$KV.lh_active.>");
    env.submit("echo", json!({"input": {}}), "parked-fast")
        .await;
    env.wait_status("parked-fast", "parked", Duration::from_secs(10))
        .await;
    // The park entry's write has reached the proxy (and was dropped)
    // before the faults end: without this wait a slow owner could write
    // it after `clear`, and the test would not test the lost write.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while proxy.published("$KV.lh_active.park.>") == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the owner never tried to write the park entry"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let active = env.active().await;
    assert!(
        active.list(Filter::Parked).await.unwrap().is_empty(),
        "the park entry's write was lost"
    );
    proxy.clear();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        match active.list(Filter::Parked).await {
            Ok(l) if !l.is_empty() => break,
            Ok(_) => {}
            Err(e) => eprintln!("listing the parked jobs failed (tried again): {e}"),
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the parked job is listed once its kept ticket comes back"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.cancel();
    w.wait().await.unwrap();
}

// Issue 30, F7: the owner's terminal event was best-effort after its
// terminal write. A kill -9 between the two (here: the `completed` publish
// provably sent and never delivered when the owner dies) left a finished
// record with no terminal event: a client's stream never ended, and
// retention, which reads terminal events, kept the job for ever. The
// ticket, acked only after the event, and the index entry now bring the
// job back to a claim or a recoverer that publishes the event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_between_the_terminal_write_and_its_event_still_ends_the_job() {
    let env = Fleet::start().await;
    let proxy = FaultProxy::start(&env.url()).await;
    let mut a = env.worker_proc(
        &["--worker-id", "dies-at-end"],
        &[("NATS_URL", proxy.url())],
    );
    wait_log(&a, "worker starting", Duration::from_secs(10)).await;
    let hold = proxy.hold("lh.events.end-lost.completed");
    env.submit("sleep", json!({"input": {"ms": 800}}), "end-lost")
        .await;
    tokio::time::timeout(Duration::from_secs(20), hold.triggered())
        .await
        .expect("the owner published its completed event");
    a.kill9();
    let done = env.record("end-lost").await.unwrap();
    assert_eq!(done.status, "completed", "the terminal write came first");
    // Another worker and a reaper; retention short enough to see the job go.
    let (w, stop_w) = env.worker().await;
    let mut o = env.reaper_opts();
    o.retention = Duration::from_secs(2);
    let (r, stop_r) = env.reaper_with(o).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let completed = loop {
        let n = env
            .events_of("end-lost")
            .await
            .iter()
            .filter(|e| e.r#type == "completed")
            .count();
        if n > 0 {
            break n;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the finished job never got its completed event"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(completed, 1);
    // Retention finds it by that event, and forgets it.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while env.jobs.get("end-lost").await.unwrap().is_some() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the finished job was never forgotten"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop_w.cancel();
    w.wait().await.unwrap();
    stop_r.cancel();
    r.wait().await.unwrap();
}

// Issue 31: an attempt's end publishes what goes before its record write
// (a retry's event and its fresh ticket), then writes the record. A worker
// killed in between leaves a ticket that no record names yet and a record
// still `running` under a session that is gone: the job is reclaimed once,
// its lost failure is run again, and it completes exactly once.
#[tokio::test]
async fn a_kill_between_a_retrys_ticket_and_its_record_runs_the_job_once_more() {
    let env = Fleet::start().await;
    let proxy = FaultProxy::start(&env.url()).await;
    let mut a = env.worker_proc(
        &["--worker-id", "dies-mid-retry"],
        &[("NATS_URL", proxy.url())],
    );
    wait_log(&a, "worker starting", Duration::from_secs(10)).await;
    env.submit(
        "fail",
        json!({"input": {"class": "retryable", "times": 1, "ms": 1500}}),
        "mid-retry",
    )
    .await;
    // Indexed: the attempt writes nothing more to its record until its end.
    env.wait_indexed("mid-retry", Duration::from_secs(10)).await;
    let hold = proxy.hold("$KV.lh_jobs.>");
    tokio::time::timeout(Duration::from_secs(20), hold.triggered())
        .await
        .expect("the owner tried to write its retry");
    let tickets = proxy.published(&format!("{}.submit.fail", env.prefix));
    assert_eq!(tickets, 1, "the retry's ticket went out before its record");
    a.kill9();
    proxy.cut();
    let before = env.record("mid-retry").await.unwrap();
    assert_eq!(
        (before.status.as_str(), before.attempts, before.epoch),
        ("running", 0, 1),
        "the retry's record write never landed"
    );
    let (r, stop_r) = start_reaper(&env).await;
    let (w, stop_w) = env.worker().await;
    let done = env
        .wait_status("mid-retry", "completed", Duration::from_secs(60))
        .await;
    // The lost failure ran again (attempt 1 at epoch 2), then the retry.
    assert_eq!(done.attempts, 1, "{done:?}");
    assert_eq!(done.stale_reclaims, 1, "reclaimed once: {done:?}");
    // The record is written before its `completed` event.
    env.wait_event("mid-retry", "completed", Duration::from_secs(10))
        .await;
    let events = env.events_of("mid-retry").await;
    let completed = events.iter().filter(|e| e.r#type == "completed").count();
    assert_eq!(completed, 1, "completed exactly once: {events:?}");
    assert!(
        events
            .iter()
            .filter(|e| e.r#type == "completed")
            .all(|e| e.epoch == done.epoch),
        "only the last owner completed it: {events:?}"
    );
    stop_w.cancel();
    w.wait().await.unwrap();
    stop_r.cancel();
    r.wait().await.unwrap();
}
