//! Job-level retries, terminal errors, budgets and cancellation.

use std::time::Duration;

use serde_json::json;

use leasehold_testkit::Fleet;

#[tokio::test]
async fn retryable_errors_requeue_with_backoff_then_complete() {
    let env = Fleet::start().await;
    let (w, stop) = env.worker().await;
    env.submit(
        "fail",
        json!({"input": {"class": "retryable", "times": 2}}),
        "flaky",
    )
    .await;
    let r = env
        .wait_status("flaky", "completed", Duration::from_secs(20))
        .await;
    assert_eq!((r.attempts, r.epoch), (2, 3));
    let history = env.jobs.history("flaky").await.unwrap();
    let requeues: Vec<_> = history
        .iter()
        .filter(|v| v.value.status == "queued" && v.value.next_run_at.is_some())
        .collect();
    assert_eq!(requeues.len(), 2, "two requeues with next_run_at");
    let retries: Vec<_> = env
        .events_of("flaky")
        .await
        .into_iter()
        .filter(|e| e.r#type == "retry")
        .collect();
    assert_eq!(retries.len(), 2);
    let d = retries[0].data_map();
    assert_eq!(
        (
            d["scope"].as_str(),
            d["attempt"].as_u64(),
            d["eligible"].as_bool()
        ),
        (Some("job"), Some(1), Some(true))
    );
    assert!(
        d["delay_ms"].as_u64().unwrap() <= 100,
        "full jitter below the first ceiling (100ms)"
    );
    stop.cancel();
    w.wait().await.unwrap();
}

#[tokio::test]
async fn terminal_errors_are_never_retried_and_budgets_run_out() {
    let env = Fleet::start().await;
    let (w, stop) = env.worker().await;
    env.submit(
        "fail",
        json!({"input": {"class": "terminal", "times": 5}}),
        "fatal",
    )
    .await;
    env.submit(
        "fail",
        json!({"input": {"class": "retryable", "times": 99}, "retry": {"max_attempts": 3}}),
        "hopeless",
    )
    .await;
    let fatal = env
        .wait_status("fatal", "failed", Duration::from_secs(15))
        .await;
    assert_eq!((fatal.attempts, fatal.epoch), (1, 1));
    assert_eq!(fatal.error.unwrap().class, "terminal");
    let hopeless = env
        .wait_status("hopeless", "failed", Duration::from_secs(20))
        .await;
    assert_eq!(hopeless.attempts, 3);
    let e = hopeless.error.unwrap();
    assert_eq!(e.class, "exhausted");
    assert!(e.message.contains("3 attempts"), "{}", e.message);
    stop.cancel();
    w.wait().await.unwrap();
}

async fn cancel(env: &Fleet, id: &str) -> serde_json::Value {
    let m = env
        .conn
        .client
        .request(format!("lh.cancel.{id}"), "".into())
        .await
        .unwrap();
    serde_json::from_slice(&m.payload).unwrap()
}

#[tokio::test]
async fn cancellation_while_queued_running_and_in_backoff() {
    let env = Fleet::start().await;
    // Queued: nobody runs it yet; the cancel is answered through the CLI's
    // direct path semantics (same transition) by a worker's gateway below.
    let (w, stop) = env.worker().await;
    let mut o = env.opts();
    o.kinds = vec!["fail".into()];
    o.retry_base = Duration::from_secs(30);
    o.retry_cap = Duration::from_secs(30);
    // Running: the owner is told and a long sleep stops at once.
    env.submit("sleep", json!({"input": {"ms": 60000}}), "long")
        .await;
    env.wait_status("long", "running", Duration::from_secs(10))
        .await;
    let reply = cancel(&env, "long").await;
    assert_eq!(reply["outcome"], "requested", "{reply}");
    let t0 = tokio::time::Instant::now();
    let r = env
        .wait_status("long", "cancelled", Duration::from_secs(5))
        .await;
    assert!(
        // A notification, one write, with slack for a loaded CI machine.
        t0.elapsed() < Duration::from_secs(2),
        "stopped at once: {:?}",
        t0.elapsed()
    );
    assert!(r.cancel_requested);
    stop.cancel();
    w.wait().await.unwrap();

    // Queued: with no worker for sleep running, the job waits; cancelling
    // it is immediate and a later worker drops the ticket.
    let (w2, stop2) = env.worker_with(o).await;
    env.submit("sleep", json!({"input": {"ms": 1}}), "queued")
        .await;
    let rec = leasehold_testkit::record::new_record(
        "queued",
        "sleep",
        Default::default(),
        0,
        std::time::SystemTime::now(),
    );
    let _ = env.jobs.create(&rec).await;
    let reply = cancel(&env, "queued").await;
    assert_eq!(reply["outcome"], "cancelled", "{reply}");
    // Backoff: the first failure requeues with a 30 s ceiling; the cancel
    // ends the wait at once and the job never runs again.
    env.submit("fail", json!({"input": {"class": "retryable", "times": 9}, "retry": {"base_ms": 30000, "cap_ms": 30000}}), "backoff").await;
    env.wait_for("backoff", Duration::from_secs(10), |r| {
        r.status == "queued" && r.attempts == 1
    })
    .await;
    let reply = cancel(&env, "backoff").await;
    assert_eq!(reply["outcome"], "cancelled", "{reply}");
    stop2.cancel();
    w2.wait().await.unwrap();
    let (w3, stop3) = env.worker().await;
    env.submit("echo", json!({"input": {}}), "sentinel").await;
    env.wait_status("sentinel", "completed", Duration::from_secs(10))
        .await;
    for id in ["queued", "backoff"] {
        let r = env.record(id).await.unwrap();
        assert_eq!(r.status, "cancelled", "{id}");
    }
    assert_eq!(
        env.record("backoff").await.unwrap().attempts,
        1,
        "never retried"
    );
    assert_eq!(
        env.record("queued").await.unwrap().epoch,
        0,
        "never claimed"
    );
    stop3.cancel();
    w3.wait().await.unwrap();
}

#[tokio::test]
async fn a_large_input_and_output_live_beside_a_small_record() {
    let env = Fleet::start().await;
    let (w, stop) = env.worker().await;
    let big = "x".repeat(200_000);
    env.submit("echo", json!({"input": {"text": big}}), "big")
        .await;
    let done = env
        .wait_status("big", "completed", Duration::from_secs(10))
        .await;
    // The record as read through the store is whole...
    assert!(done.input_beside && done.output_beside);
    let v = env.record("big").await.unwrap();
    assert!(v.spec.as_ref().unwrap().input.contains(&big));
    assert!(v.result.as_ref().unwrap().output.contains(&big));
    // ...while what every write stores stays small.
    let raw = env.jobs.kv().get("big").await.unwrap().unwrap();
    assert!(raw.len() < 4096, "stored record is {} bytes", raw.len());
    let history = env.jobs.kv().history("big").await.unwrap();
    let sizes: Vec<usize> = futures::StreamExt::collect::<Vec<_>>(history)
        .await
        .into_iter()
        .map(|e| e.unwrap().value.len())
        .collect();
    assert!(sizes.iter().all(|n| *n < 4096), "{sizes:?}");
    stop.cancel();
    w.wait().await.unwrap();
}

// Issue 18: an input over 16 KiB whose payload was removed (retention, an
// operator) came back as an empty value and the job ran on `null`; an
// output likewise printed `null`. A missing payload is an error.
#[tokio::test]
async fn a_missing_payload_is_an_error_never_an_empty_value() {
    let env = Fleet::start().await;
    let payloads = env.conn.js.get_key_value("lh_payloads").await.unwrap();
    // An output kept beside its record, then gone: `result` says so.
    let (w, stop) = env.worker().await;
    let big = "y".repeat(40_000);
    env.submit("echo", json!({"input": {"text": big}}), "big-out")
        .await;
    let done = env
        .wait_status("big-out", "completed", Duration::from_secs(60))
        .await;
    assert!(done.output_beside);
    payloads
        .purge(format!("big-out.output.{}", done.epoch))
        .await
        .unwrap();
    let out = tokio::process::Command::new(leasehold_harness::bin_path("leasehold"))
        .args(["result", "big-out"])
        .env("NATS_URL", env.url())
        .output()
        .await
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("output") && err.contains("gone"), "{err}");
    assert!(out.stdout.is_empty(), "no value printed");
    stop.cancel();
    w.wait()
        .await
        .expect("the worker stops and hands everything back");
    // An input kept beside a queued record, then gone: the job fails with
    // the reason instead of running on nothing.
    let mut rec = leasehold_testkit::record::new_record(
        "big-in",
        "echo",
        leasehold_testkit::record::JobSpec {
            input: json!({"text": big}).to_string(),
            ..Default::default()
        },
        0,
        std::time::SystemTime::now(),
    );
    env.jobs.externalize(&mut rec).await.unwrap();
    env.jobs.create(&rec).await.unwrap();
    payloads.purge("big-in.input").await.unwrap();
    // A ticket that does not carry the input itself (a small one under
    // the same id): the claim runs the record's.
    env.submit("echo", json!({"input": {"small": 1}}), "big-in")
        .await;
    let (w, stop) = env.worker().await;
    let failed = env
        .wait_for("big-in", Duration::from_secs(60), |r| {
            matches!(r.status.as_str(), "failed" | "completed")
        })
        .await;
    assert_eq!(failed.status, "failed", "{failed:?}");
    let why = failed.error.unwrap().message;
    assert!(why.contains("input") && why.contains("gone"), "{why}");
    stop.cancel();
    w.wait()
        .await
        .expect("the worker stops and hands everything back");
}
