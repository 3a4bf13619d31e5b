//! `leasehold watch` as CI runs it (stdout a file, not a terminal): one
//! plain line per change while the job goes, why it waits, its retries and
//! last error, a closing summary, and Ctrl-C.

use std::time::Duration;

use leasehold_harness::Proc;
use serde_json::json;

use leasehold_testkit::{wait_log, Fleet};

/// `leasehold watch ID --wait-for-id` as a child process whose output goes
/// to a file (so its stdout is not a terminal).
fn watch(env: &Fleet, id: &str) -> Proc {
    Proc::spawn(
        "leasehold",
        &["watch", id, "--wait-for-id"],
        &[("NATS_URL", env.url()), ("LH_PREFIX", env.prefix.clone())],
    )
}

/// The exit code of `p`, which must end within `timeout`; waits without
/// blocking the runtime the test's worker runs on.
async fn exit_code(p: &mut Proc, timeout: Duration) -> i32 {
    let deadline = tokio::time::Instant::now() + timeout;
    while p.alive() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "watch did not end:\n{}",
            p.output()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let st = p.wait_timeout(Duration::ZERO).expect("exited");
    st.code().unwrap_or(-1)
}

#[tokio::test]
async fn off_a_terminal_each_change_is_a_plain_line_printed_while_the_job_runs() {
    let env = Fleet::start().await;
    let (w, stop) = env.worker().await;
    // Fails twice, each attempt 1.5 s long, then completes.
    let id = env
        .submit(
            "fail",
            json!({"input": {"class": "retryable", "times": 2, "ms": 1500}}),
            "w-retry",
        )
        .await;
    let mut p = watch(&env, &id);
    // The first failure is printed while the job still has two attempts
    // (3 s of work) to go.
    wait_log(
        &p,
        "last error retryable: injected failure 1 of 2",
        Duration::from_secs(20),
    )
    .await;
    let now = env.record(&id).await.unwrap();
    assert_ne!(
        now.status,
        "completed",
        "the line came before the end:\n{}",
        p.output()
    );
    assert_eq!(
        exit_code(&mut p, Duration::from_secs(30)).await,
        0,
        "{}",
        p.output()
    );
    let out = p.output();
    assert!(
        !out.contains('\u{1b}') && !out.contains('\r'),
        "plain lines only:\n{out}"
    );
    let lines: Vec<&str> = out.lines().collect();
    let (summary, changes) = lines.split_last().expect("some output");
    for l in changes {
        // `2026-12-01T10:00:00.000Z w-retry ...`
        assert!(
            l.len() > 25 && l.as_bytes()[10] == b'T' && l[25..].starts_with("w-retry "),
            "a timestamped line per change: {l:?}\n{out}"
        );
    }
    assert!(out.contains("w-retry running on "), "{out}");
    assert!(
        out.contains("2 failed attempts"),
        "the retries are shown:\n{out}"
    );
    assert!(
        !out.contains("0/1"),
        "no section bar for a job without sections:\n{out}"
    );
    assert!(
        summary.starts_with("w-retry completed in ")
            && summary.ends_with("after 2 failed attempts → leasehold result w-retry"),
        "{summary}"
    );
    stop.cancel();
    w.wait().await.unwrap();
}

#[tokio::test]
async fn a_failed_job_ends_with_its_class_message_duration_and_what_to_run() {
    let env = Fleet::start().await;
    let (w, stop) = env.worker().await;
    let id = env
        .submit(
            "fail",
            json!({"input": {"class": "retryable", "times": 5, "ms": 300}, "retry": {"max_attempts": 2}}),
            "w-fail",
        )
        .await;
    let mut p = watch(&env, &id);
    assert_eq!(
        exit_code(&mut p, Duration::from_secs(30)).await,
        1,
        "{}",
        p.output()
    );
    let out = p.output();
    assert!(
        out.contains("last error retryable: injected failure 1 of 5"),
        "the retry's error is shown as it happens:\n{out}"
    );
    let summary = out.lines().last().unwrap();
    assert!(
        summary.starts_with("w-fail failed in ")
            && summary.contains(": exhausted: injected failure 2 of 5")
            && summary.ends_with("→ leasehold result w-fail"),
        "{summary}"
    );
    stop.cancel();
    w.wait().await.unwrap();
}

#[tokio::test]
async fn a_parked_job_is_shown_parked_with_its_reason() {
    let env = Fleet::start().await;
    let (w, stop) = env.worker().await;
    let id = env
        .submit("fail", json!({"input": {"class": "park"}}), "w-park")
        .await;
    let mut p = watch(&env, &id);
    assert_eq!(
        exit_code(&mut p, Duration::from_secs(30)).await,
        1,
        "{}",
        p.output()
    );
    let out = p.output();
    let summary = out.lines().last().unwrap();
    assert!(
        summary.starts_with("w-park parked: injected: a park for review (test kind)")
            && summary.ends_with("→ leasehold review list"),
        "{summary}"
    );
    stop.cancel();
    w.wait().await.unwrap();
}

#[tokio::test]
async fn ctrl_c_ends_a_watch_at_once_with_130_and_the_job_goes_on() {
    let env = Fleet::start().await;
    let (w, stop) = env.worker().await;
    let id = env
        .submit("sleep", json!({"input": {"ms": 60000}}), "w-int")
        .await;
    let mut p = watch(&env, &id);
    wait_log(&p, "w-int running on ", Duration::from_secs(20)).await;
    p.interrupt();
    assert_eq!(
        exit_code(&mut p, Duration::from_secs(3)).await,
        130,
        "{}",
        p.output()
    );
    assert!(
        p.output().contains("interrupted; job w-int goes on"),
        "{}",
        p.output()
    );
    let now = env.record(&id).await.unwrap();
    assert_eq!(now.status, "running");
    stop.cancel();
    w.wait().await.unwrap();
}

#[tokio::test]
async fn a_queued_job_says_how_many_tickets_of_its_kind_are_in_the_queue() {
    let env = Fleet::start().await;
    let mut o = env.opts();
    o.concurrency = 1;
    let (w, stop) = env.worker_with(o).await;
    // One slot, taken by a long job whose ticket is settled once indexed.
    let busy = env
        .submit("sleep", json!({"input": {"ms": 60000}}), "w-busy")
        .await;
    env.wait_indexed(&busy, Duration::from_secs(20)).await;
    // Two more, with their queued records written at submit.
    for id in ["w-next", "w-last"] {
        let (code, out, err) = leasehold_testkit::cli(
            &env.url(),
            &["submit", "sleep", "--id", id, "--input", r#"{"ms":100}"#],
        )
        .await;
        assert_eq!(code, 0, "{out}{err}");
    }
    let p = watch(&env, "w-last");
    // Its own ticket and w-next's are in the work queue.
    wait_log(
        &p,
        "w-last queued behind 1 ticket of kind sleep",
        Duration::from_secs(20),
    )
    .await;
    drop(p);
    stop.cancel();
    w.wait().await.unwrap();
}
