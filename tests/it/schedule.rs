//! Jobs that run later: delayed jobs (`run_at`, `delay`) wait as `queued`
//! records due at `next_run_at`, cost their ticket one delivery now and one
//! when due however long the delay, and can be cancelled meanwhile.

use std::time::{Duration, SystemTime};

use leasehold_testkit::doors::reaper::Options as ReaperOptions;
use leasehold_testkit::record::{parse_rfc3339, rfc3339};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use leasehold_harness::Proc;

use leasehold_testkit::{cli, Fleet};

async fn reaper(env: &Fleet) -> CancellationToken {
    let mut o = ReaperOptions::local(&env.url(), &env.prefix);
    o.interval = Duration::from_millis(200);
    env.reaper_with(o).await.1
}

fn status_json(out: &str) -> serde_json::Value {
    serde_json::from_str(out).unwrap_or_else(|e| panic!("status is not JSON ({e}): {out}"))
}

#[tokio::test]
async fn a_delayed_job_is_queued_with_its_due_time_and_runs_only_then() {
    let env = Fleet::start().await;
    let (_w, stop) = env.worker().await;
    let url = env.url();
    let before = SystemTime::now();
    let (code, out, err) = cli(
        &url,
        &[
            "submit",
            "echo",
            r#"{"input":{"n":1}}"#,
            "--delay",
            "3s",
            "--id",
            "later-1",
        ],
    )
    .await;
    assert_eq!(code, 0, "{out}{err}");
    // Visible at once, queued, with the due time.
    let (code, out, err) = cli(&url, &["status", "later-1"]).await;
    assert_eq!(code, 0, "{err}");
    let rec = status_json(&out);
    assert_eq!(rec["status"], "queued", "{rec}");
    let due = parse_rfc3339(rec["next_run_at"].as_str().expect("next_run_at")).unwrap();
    let ahead = due.duration_since(before).unwrap();
    assert!(
        ahead >= Duration::from_millis(2500) && ahead <= Duration::from_secs(5),
        "due {ahead:?} after the submission"
    );
    assert_eq!(rec["spec"]["run_at"], rfc3339(due), "{rec}");
    let (_, out, _) = cli(&url, &["list", "--json"]).await;
    assert!(out.contains("later-1"), "list shows the waiting job: {out}");
    // Still queued shortly before it is due.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(env.record("later-1").await.unwrap().status, "queued");
    let done = env
        .wait_status("later-1", "completed", Duration::from_secs(15))
        .await;
    let claimed = env
        .events_of("later-1")
        .await
        .into_iter()
        .find(|e| e.r#type == "claimed")
        .expect("claimed event");
    let claimed_at = parse_rfc3339(&claimed.at).unwrap();
    assert!(
        claimed_at >= due,
        "claimed at {} before its due time {}",
        claimed.at,
        rfc3339(due)
    );
    assert_eq!(done.epoch, 1);
    stop.cancel();
}

/// A delayed job's queued record is made by one function whoever makes it:
/// a submitter that asks the gateway (`leasehold submit`), or the claim of
/// a ticket published by a plain NATS client that asks nobody. Both keep
/// the trace the submission named, and both are listed as waiting.
#[tokio::test]
async fn a_delayed_jobs_record_keeps_its_trace_whether_the_gateway_or_its_claim_makes_it() {
    let env = Fleet::start().await;
    let (_w, stop) = env.worker().await;
    let url = env.url();
    let sent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let run_at = rfc3339(SystemTime::now() + Duration::from_secs(60));
    // A plain publish: no `lh.enqueued` ask, so the claim records it.
    let spec = json!({"input": {"n": 1}, "run_at": run_at});
    env.work
        .submit_traced(
            "echo",
            spec.to_string().into(),
            Some("later-raw"),
            None,
            Some(sent),
        )
        .await
        .unwrap();
    // Through the CLI, which asks the gateway for the record.
    let (code, out, err) = cli(
        &url,
        &[
            "submit",
            "echo",
            r#"{"input":{"n":2}}"#,
            "--run-at",
            &run_at,
            "--id",
            "later-cli",
            "--traceparent",
            sent,
        ],
    )
    .await;
    assert_eq!(code, 0, "{out}{err}");
    for id in ["later-raw", "later-cli"] {
        let rec = env
            .wait_for(id, Duration::from_secs(10), |r| r.status == "queued")
            .await;
        assert_eq!(rec.traceparent.as_deref(), Some(sent), "{id}: {rec:?}");
        assert_eq!(rec.next_run_at.as_deref(), Some(run_at.as_str()), "{id}");
        // The entry follows the record's create.
        env.wait_listed(id, "waiting", Duration::from_secs(10), |k| {
            matches!(k, leasehold_testkit::doors::index::Key::Wait { .. })
        })
        .await;
    }
    let (_, out, _) = cli(&url, &["list", "--status", "queued", "--json"]).await;
    for id in ["later-raw", "later-cli"] {
        assert!(out.contains(id), "list shows {id} waiting: {out}");
    }
    stop.cancel();
}

#[tokio::test]
async fn a_delayed_job_cancelled_before_it_is_due_never_runs() {
    let env = Fleet::start().await;
    let (_w, stop) = env.worker().await;
    let url = env.url();
    let (code, out, err) = cli(
        &url,
        &[
            "submit",
            "echo",
            r#"{"input":{}}"#,
            "--delay",
            "3s",
            "--id",
            "later-c",
        ],
    )
    .await;
    assert_eq!(code, 0, "{out}{err}");
    let (code, out, err) = cli(&url, &["cancel", "later-c"]).await;
    assert_eq!(code, 0, "{out}{err}");
    env.wait_status("later-c", "cancelled", Duration::from_secs(5))
        .await;
    // Past its due time it is still cancelled and was never claimed.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let rec = env.record("later-c").await.unwrap();
    assert_eq!(
        (rec.status.as_str(), rec.epoch),
        ("cancelled", 0),
        "{rec:?}"
    );
    assert!(
        !env.events_of("later-c")
            .await
            .iter()
            .any(|e| e.r#type == "claimed"),
        "a cancelled delayed job ran"
    );
    stop.cancel();
}

#[tokio::test]
async fn a_long_delay_costs_its_ticket_at_most_two_deliveries_and_is_never_dead_lettered() {
    let env = Fleet::start().await;
    let (_w, stop) = env.worker().await;
    let stop_reaper = reaper(&env).await;
    // Published raw, as any NATS client would: the worker's claim records it.
    env.submit("echo", json!({"input": {}, "delay": "1h"}), "later-long")
        .await;
    let rec = env
        .wait_status("later-long", "queued", Duration::from_secs(5))
        .await;
    let due = parse_rfc3339(rec.next_run_at.as_deref().expect("due")).unwrap();
    let ahead = due.duration_since(SystemTime::now()).unwrap();
    assert!(ahead > Duration::from_secs(3500), "{ahead:?}");
    // A few seconds of a running worker (pulling every 250 ms) and a
    // reaper sweeping every 200 ms.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let mut consumer = env.work.consumer("echo").await.unwrap();
    let info = consumer.info().await.unwrap();
    assert!(
        info.delivered.consumer_sequence <= 2,
        "the delayed ticket was delivered {} times",
        info.delivered.consumer_sequence
    );
    assert_eq!(
        info.num_ack_pending, 0,
        "the ticket was released to the job's wake-up, not held for its wait"
    );
    let rec = env.record("later-long").await.unwrap();
    assert_eq!((rec.status.as_str(), rec.epoch), ("queued", 0), "{rec:?}");
    let (_, out, _) = cli(&env.url(), &["dlq", "list", "--json"]).await;
    assert!(!out.contains("later-long"), "dead-lettered: {out}");
    stop_reaper.cancel();
    stop.cancel();
}

/// Review G8: with the kind's consumer at `max_ack_pending` 20 (as `nats
/// consumer edit --max-pending 20` would set it), 20 jobs delayed by 10
/// minutes, each delivered once, hold none of those slots: a job submitted
/// after them runs at once. Without any reaper, a delayed job still runs
/// at its time, woken by the workers: two of them race to wake it, and it
/// gets one ticket.
#[tokio::test]
async fn delayed_jobs_hold_no_ack_pending_slot_and_still_run_at_their_time() {
    let env = Fleet::start().await;
    let stream = env
        .conn
        .js
        .get_stream(env.conn.layout.work_stream())
        .await
        .unwrap();
    let name = env.conn.layout.work_consumer("echo");
    let mut cfg = stream.consumer_info(&name).await.unwrap().config;
    cfg.max_ack_pending = 20;
    stream.update_consumer(cfg).await.unwrap();
    let (_w, stop) = env.worker().await;
    for i in 0..20 {
        let id = format!("later-{i}");
        env.submit("echo", json!({"input": {}, "delay": "10m"}), &id)
            .await;
        // Recorded by the claim: its ticket was delivered.
        env.wait_status(&id, "queued", Duration::from_secs(5)).await;
    }
    env.submit("echo", json!({"input": {}}), "now").await;
    env.wait_status("now", "completed", Duration::from_secs(5))
        .await;
    // A delay past the hold releases its ticket too; it is given a new one
    // at its time.
    let (_w2, stop2) = env.worker().await;
    env.submit("echo", json!({"input": {}, "delay": "7s"}), "soon")
        .await;
    let rec = env
        .wait_status("soon", "queued", Duration::from_secs(5))
        .await;
    let last_seq = || async { stream.get_info().await.unwrap().state.last_sequence };
    let submitted = last_seq().await;
    let due = parse_rfc3339(rec.next_run_at.as_deref().expect("due")).unwrap();
    env.wait_status("soon", "completed", Duration::from_secs(15))
        .await;
    let claimed = env
        .events_of("soon")
        .await
        .into_iter()
        .find(|e| e.r#type == "claimed")
        .expect("claimed event");
    let late = parse_rfc3339(&claimed.at)
        .unwrap()
        .duration_since(due)
        .expect("claimed no sooner than due");
    assert!(late < Duration::from_secs(1), "claimed {late:?} after due");
    let info = env
        .work
        .consumer("echo")
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .clone();
    assert_eq!(info.num_ack_pending, 0, "{info:?}");
    assert_eq!(
        last_seq().await,
        submitted + 1,
        "two workers woke the job: one ticket"
    );
    stop2.cancel();
    stop.cancel();
}

#[tokio::test]
async fn bad_run_times_are_refused_with_exit_2_and_the_reason() {
    let env = Fleet::start().await;
    let url = env.url();
    let past = rfc3339(SystemTime::now() - Duration::from_secs(600));
    let far = rfc3339(SystemTime::now() + Duration::from_secs(400 * 86_400));
    let both = format!(r#"{{"input":{{}},"run_at":"{far}","delay":"1s"}}"#);
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["submit", "echo", r#"{"input":{}}"#, "--run-at", "tomorrow"],
            "run_at: \"tomorrow\" is not an RFC 3339 UTC time",
        ),
        (
            vec!["submit", "echo", r#"{"input":{}}"#, "--delay", "soon"],
            "delay: invalid duration",
        ),
        (
            vec!["submit", "echo", &both],
            "run_at: give either run_at or delay, not both",
        ),
        (
            vec!["submit", "echo", r#"{"input":{}}"#, "--run-at", &past],
            "in the past (at most 5m is tolerated",
        ),
        (
            vec!["submit", "echo", r#"{"input":{}}"#, "--run-at", &far],
            "beyond the maximum delay of 366 days",
        ),
        (
            vec!["submit", "echo", r#"{"input":{}}"#, "--delay", "400d"],
            "beyond the maximum delay of 366 days",
        ),
    ];
    for (args, want) in cases {
        let (code, out, err) = cli(&url, &args).await;
        assert_eq!(code, 2, "{args:?}: {out}{err}");
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(err.contains("nothing was submitted"), "{args:?}: {err}");
    }
    // Published raw, a bad run time is a rejection kept as a dead letter.
    let (_w, stop) = env.worker().await;
    env.submit("echo", json!({"input": {}, "run_at": "noon"}), "later-bad")
        .await;
    let rec = env
        .wait_status("later-bad", "rejected", Duration::from_secs(10))
        .await;
    let message = rec.error.map(|e| e.message).unwrap_or_default();
    assert!(message.starts_with("run_at: \"noon\""), "{message}");
    stop.cancel();
}

/// `leasehold schedule add <name> --cron <cron> echo <spec>`, which must
/// succeed; its stdout and stderr.
async fn add_echo_schedule(url: &str, name: &str, cron: &str, spec: &str) -> (String, String) {
    let (code, out, err) = cli(
        url,
        &["schedule", "add", name, "--cron", cron, "echo", spec],
    )
    .await;
    assert_eq!(code, 0, "{out}{err}");
    (out, err)
}

fn unix(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH).unwrap().as_secs()
}

#[tokio::test]
async fn bad_schedules_are_refused_with_their_exit_code_and_reason() {
    let env = Fleet::start().await;
    let url = env.url();
    let cases: Vec<(Vec<&str>, i32, &str)> = vec![
        (
            vec![
                "schedule",
                "add",
                "s1",
                "--cron",
                "61 * * * *",
                "echo",
                r#"{"input":{}}"#,
            ],
            2,
            "error: cron \"61 * * * *\" does not parse",
        ),
        (
            vec![
                "schedule",
                "add",
                "s1",
                "--cron",
                "0 0 30 2 *",
                "echo",
                r#"{"input":{}}"#,
            ],
            2,
            "error: cron \"0 0 30 2 *\" never fires",
        ),
        (
            vec![
                "schedule",
                "add",
                "s.1",
                "--cron",
                "* * * * *",
                "echo",
                r#"{"input":{}}"#,
            ],
            2,
            "error: invalid schedule name \"s.1\"",
        ),
        (
            vec![
                "schedule",
                "add",
                "s1",
                "--cron",
                "* * * * *",
                "sleep",
                r#"{"input":{}}"#,
            ],
            2,
            "error: input.ms: required",
        ),
        (
            vec!["schedule", "pause", "nope"],
            1,
            "error: no schedule named \"nope\"",
        ),
        (
            vec!["schedule", "remove", "nope"],
            1,
            "error: no schedule named \"nope\"",
        ),
    ];
    for (args, want_code, want) in cases {
        let (code, out, err) = cli(&url, &args).await;
        assert_eq!(code, want_code, "{args:?}: {out}{err}");
        assert!(err.starts_with(want), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: one line: {err}");
    }
    let (code, out, err) = cli(&url, &["schedule", "list", "--json"]).await;
    assert_eq!((code, out.as_str()), (0, ""), "{err}");
}

#[tokio::test]
async fn a_schedule_fires_exactly_once_per_tick_with_two_reapers_one_killed_at_a_tick() {
    let env = Fleet::start().await;
    let (_w, stop) = env.worker().await;
    let url = env.url();
    let renv = vec![
        ("NATS_URL", url.clone()),
        ("LH_PREFIX", env.prefix.clone()),
        ("LH_INTERVAL", "200ms".to_string()),
        ("LH_PROBE_INTERVAL", "0".to_string()),
        ("RUST_LOG", "info".to_string()),
    ];
    let mut r1 = Proc::spawn("leasehold-reaper", &[], &renv);
    let r2 = Proc::spawn("leasehold-reaper", &[], &renv);
    leasehold_testkit::wait_log(&r1, "sweep", Duration::from_secs(20)).await;
    leasehold_testkit::wait_log(&r2, "sweep", Duration::from_secs(20)).await;
    let added = SystemTime::now();
    let (out, err) = add_echo_schedule(&url, "tick", "*/2 * * * * *", r#"{"input":{"n":1}}"#).await;
    assert!(err.starts_with("schedule tick added; next tick "), "{err}");
    let doc: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(doc["state"], "added", "{out}");
    let first = unix(added) / 2 * 2 + 2;
    // Both reapers fire the first ticks; then one dies at a tick. (The
    // first tick's wait is generous: a loaded machine once took longer
    // than 10 s to see the new schedule; what is asserted is once per
    // tick, not how soon.)
    let first_id = format!("tick-{first}");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while env
        .record(&first_id)
        .await
        .is_none_or(|r| r.status != "completed")
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{first_id} not completed within 30s: {:?}\nreaper 1:\n{}\nreaper 2:\n{}",
            env.record(&first_id).await,
            r1.output(),
            r2.output()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let kill_tick = first + 4;
    let at = SystemTime::UNIX_EPOCH + Duration::from_secs(kill_tick);
    if let Ok(d) = at.duration_since(SystemTime::now()) {
        tokio::time::sleep(d + Duration::from_millis(50)).await;
    }
    r1.kill9();
    tokio::time::sleep(Duration::from_secs(6)).await;
    let (code, out, err) = cli(&url, &["schedule", "pause", "tick"]).await;
    assert_eq!(code, 0, "{out}{err}");
    let paused = unix(SystemTime::now());
    tokio::time::sleep(Duration::from_secs(4)).await;
    // Every tick from the first to the pause made exactly one job, which
    // ran once; none was lost when a reaper died at its tick.
    let mut tick = first;
    while tick + 1 < paused {
        let id = format!("tick-{tick}");
        let rec = env
            .wait_status(&id, "completed", Duration::from_secs(10))
            .await;
        assert_eq!(rec.epoch, 1, "{id} ran more than once");
        let claims = env
            .events_of(&id)
            .await
            .iter()
            .filter(|e| e.r#type == "claimed")
            .count();
        assert_eq!(claims, 1, "{id}");
        tick += 2;
    }
    assert!(tick - first >= 10, "ticks {first}..{tick} checked");
    // Nothing fired before the schedule existed, or after its pause.
    assert!(env
        .jobs
        .get(&format!("tick-{}", first - 2))
        .await
        .unwrap()
        .is_none());
    for t in (paused / 2 * 2 + 2..paused + 5).step_by(2) {
        assert!(
            env.jobs.get(&format!("tick-{t}")).await.unwrap().is_none(),
            "tick {t} fired after the pause"
        );
    }
    let (code, out, _) = cli(&url, &["schedule", "list", "--json"]).await;
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(
        (v["name"].as_str(), v["paused"].as_bool()),
        (Some("tick"), Some(true)),
        "{v}"
    );
    assert!(v["last_job"].as_str().unwrap().starts_with("tick-"), "{v}");
    assert!(r2.output().contains("schedule fired"), "{}", r2.output());
    drop(r2);
    stop.cancel();
}

#[tokio::test]
async fn a_delayed_job_that_fails_once_is_retried_and_completes() {
    // Its retry's ticket is re-issued from the record (without a run time:
    // the record's next_run_at decides). That a run time more than 5m old
    // is not refused on a retry is by construction (`Work::reissue`), not
    // shown here: that would take 5 minutes.
    let env = Fleet::start().await;
    let (_w, stop) = env.worker().await;
    env.submit(
        "fail",
        json!({"input": {"class": "retryable", "times": 1}, "delay": "1s"}),
        "later-retry",
    )
    .await;
    let rec = env
        .wait_status("later-retry", "completed", Duration::from_secs(15))
        .await;
    assert_eq!((rec.attempts, rec.epoch), (1, 2), "{rec:?}");
    stop.cancel();
}

// A schedule of a kind that is not set up failed at every tick; it is
// refused when added, naming the kinds set up.
#[tokio::test]
async fn a_schedule_of_a_kind_not_set_up_is_refused() {
    let env = Fleet::with(leasehold_testkit::SetupOptions {
        kinds: vec!["echo".into()],
        ..Default::default()
    })
    .await;
    let (code, out, err) = cli(
        &env.url(),
        &[
            "schedule",
            "add",
            "naps",
            "--cron",
            "* * * * *",
            "sleep",
            r#"{"input":{"ms":1}}"#,
        ],
    )
    .await;
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        err.starts_with("error: kind \"sleep\" is not set up (set up: echo)"),
        "{err}"
    );
    let (code, out, err) = cli(&env.url(), &["schedule", "list", "--json"]).await;
    assert_eq!((code, out.as_str()), (0, ""), "nothing stored: {err}");
}

/// Review G13: a reaper with the default 10 s interval (its sweeps 10 s
/// apart) fires every tick of a `*/2` schedule, each at its time rather
/// than at the next sweep, and each once.
#[tokio::test]
async fn a_seconds_schedule_fires_every_tick_at_its_time_whatever_the_sweep_interval() {
    let env = Fleet::start().await;
    let (_w, stop) = env.worker().await;
    let o = ReaperOptions::local(&env.url(), &env.prefix);
    assert_eq!(o.interval, Duration::from_secs(10));
    let (reaper, stop_reaper) = env.reaper_with(o).await;
    let added = SystemTime::now();
    add_echo_schedule(&env.url(), "fine", "*/2 * * * * *", r#"{"input":{}}"#).await;
    let first = unix(added) / 2 * 2 + 2;
    // Six ticks: ten seconds, within one sweep interval.
    for tick in (first..first + 12).step_by(2) {
        let id = format!("fine-{tick}");
        let rec = env
            .wait_status(&id, "completed", Duration::from_secs(15))
            .await;
        assert_eq!(rec.epoch, 1, "{id} ran more than once");
        let at = SystemTime::UNIX_EPOCH + Duration::from_secs(tick);
        let late = parse_rfc3339(&rec.created_at)
            .unwrap()
            .duration_since(at)
            .unwrap_or_default();
        assert!(
            late < Duration::from_secs(1),
            "{id} fired {late:?} after its tick"
        );
    }
    assert!(env
        .jobs
        .get(&format!("fine-{}", first - 2))
        .await
        .unwrap()
        .is_none());
    stop_reaper.cancel();
    reaper.wait().await.unwrap();
    stop.cancel();
}

/// A reaper follows the schedules with a watch: an unreadable entry is
/// skipped and holds no other schedule back, and a removed schedule fires
/// no more.
#[tokio::test]
async fn an_unreadable_schedule_holds_no_other_back_and_a_removed_one_fires_no_more() {
    let env = Fleet::start().await;
    let (_w, stop) = env.worker().await;
    let bucket = env.conn.layout.schedules_bucket();
    let kv = env.conn.js.get_key_value(&bucket).await.unwrap();
    kv.put("bad", "not a schedule".into()).await.unwrap();
    let (reaper, stop_reaper) = env
        .reaper_with(ReaperOptions {
            interval: Duration::from_millis(200),
            ..ReaperOptions::local(&env.url(), &env.prefix)
        })
        .await;
    let added = SystemTime::now();
    add_echo_schedule(&env.url(), "every", "* * * * * *", r#"{"input":{}}"#).await;
    // Three ticks fire, past the unreadable entry.
    let first = unix(added) + 1;
    for tick in first..first + 3 {
        env.wait_status(
            &format!("every-{tick}"),
            "completed",
            Duration::from_secs(15),
        )
        .await;
    }
    let (code, out, err) = cli(&env.url(), &["schedule", "remove", "every"]).await;
    assert_eq!(code, 0, "{out}{err}");
    let removed = unix(SystemTime::now());
    // Over the next two ticks (and ten checks) nothing more fires.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    for tick in removed + 1..removed + 3 {
        assert!(
            env.jobs
                .get(&format!("every-{tick}"))
                .await
                .unwrap()
                .is_none(),
            "every-{tick} fired after the schedule's removal"
        );
    }
    stop_reaper.cancel();
    reaper.wait().await.unwrap();
    stop.cancel();
}
