//! Signals (`ctx.wait_for`, `leasehold signal`, `lh.signal.<job>.<name>`):
//! a job that waits for one holds no worker and is listed `waiting`; a
//! signal wakes it with its data; one sent before the wait is kept for it;
//! two of one name are two waits' answers, in order; a timeout ends a wait
//! with nothing; and no signal is slept through, whatever moment it comes
//! at: while the owner writes its wait, or while a dead owner's job is
//! being reclaimed.

use std::time::Duration;

use leasehold_harness::FaultProxy;
use leasehold_testkit::doors::index::Key;
use leasehold_testkit::doors::signals::Signals;
use leasehold_testkit::{cli, wait_log, Fleet};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

/// The signals a finished `hark` job took (its output's `got`).
async fn got(env: &Fleet, id: &str) -> Vec<Value> {
    let done = env
        .wait_status(id, "completed", Duration::from_secs(30))
        .await;
    let out: Value = serde_json::from_str(&done.result.as_ref().unwrap().output).unwrap();
    out["got"].as_array().cloned().unwrap_or_default()
}

/// `leasehold signal ID NAME --data DATA`: its exit code and JSON answer.
async fn signal(env: &Fleet, id: &str, name: &str, data: &str) -> (i32, Value, String) {
    let (code, out, err) = cli(&env.url(), &["signal", id, name, "--data", data]).await;
    (
        code,
        serde_json::from_str(out.trim()).unwrap_or(Value::Null),
        err,
    )
}

#[tokio::test]
async fn a_job_waiting_for_a_signal_holds_no_slot_and_the_signal_wakes_it_with_its_data() {
    let env = Fleet::with_kind("hark").await;
    let (w, stop) = env.one_slot_worker("hark", leasehold_tests::Hark).await;
    env.submit("hark", json!({"input": {"name": "confirmation"}}), "hark-1")
        .await;
    let waiting = env
        .wait_status("hark-1", "waiting", Duration::from_secs(10))
        .await;
    assert_eq!(waiting.waiting_for.as_deref(), Some("signal:confirmation"));
    assert_eq!(waiting.waiting_step.as_deref(), Some("wait:confirmation#0"));
    assert_eq!(waiting.next_run_at, None, "no timeout: no time wakes it");
    assert_eq!(waiting.session, None, "no worker holds a waiting job");
    assert_eq!(waiting.ticket_seq, 0, "a waiting job holds no ticket");
    env.wait_listed("hark-1", "held", Duration::from_secs(5), |k| {
        matches!(k, Key::Hold { .. })
    })
    .await;
    assert!(
        env.active()
            .await
            .kv()
            .get("due.hark-1")
            .await
            .unwrap()
            .is_none(),
        "a wait without a timeout has no wake-up time"
    );
    let ev = env
        .wait_event("hark-1", "waiting", Duration::from_secs(5))
        .await;
    let d = ev.last().unwrap().data_map();
    assert_eq!(
        (d["for"].as_str(), d["name"].as_str()),
        (Some("signal"), Some("confirmation"))
    );
    // `list` and `watch` say what it waits for, and `watch` how to send it.
    let (code, out, err) = cli(&env.url(), &["list", "--status", "waiting"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(
        out.lines().any(|l| l.starts_with("hark-1 ")
            && l.contains("waits for signal `confirmation` (wait:confirmation#0)")),
        "{out}"
    );
    let (code, out, err) = cli(&env.url(), &["watch", "hark-1", "--timeout", "2s"]).await;
    assert_eq!(code, 124, "still waiting when the watch stops: {err}");
    assert!(
        out.contains("waiting for signal `confirmation`")
            && out.contains("leasehold signal hark-1 confirmation"),
        "{out}"
    );

    // Its one slot is free.
    env.submit("echo", json!({"input": {"n": 1}}), "meanwhile")
        .await;
    env.wait_status("meanwhile", "completed", Duration::from_secs(10))
        .await;
    assert_eq!(env.record("hark-1").await.unwrap().status, "waiting");

    let (code, sent, err) = signal(&env, "hark-1", "confirmation", r#"{"ok": true}"#).await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(sent["waited_for"], json!(true), "{sent}");
    let got = got(&env, "hark-1").await;
    assert_eq!(got.len(), 1);
    assert_eq!(got[0]["data"], json!({"ok": true}));
    assert_eq!(got[0]["seq"], sent["seq"]);
    assert!(
        got[0]["sender"].as_str().unwrap_or("").ends_with("via cli"),
        "{got:?}"
    );
    assert_eq!(env.steps_recorded("hark-1", "wait:confirmation#0").await, 1);
    assert_eq!(
        w.metrics
            .total(leasehold::Count::Ended(leasehold::AttemptOutcome::Waited)),
        1
    );
    stop.cancel();
    w.wait().await.unwrap();
}

#[tokio::test]
async fn signals_sent_before_the_wait_are_kept_and_two_of_one_name_are_taken_in_order() {
    let env = Fleet::with_kind("hark").await;
    // Sent before the job even runs: one as `nats pub` sends it (text, no
    // sender), one through the API.
    let subject = env.conn.layout.signal_subject("hark-kept", "go");
    let ack = env
        .conn
        .js
        .publish(subject, "first".into())
        .await
        .unwrap()
        .await
        .unwrap();
    let second = Signals::new(&env.conn)
        .send("hark-kept", "go", &json!({"n": 2}), None, Some("test"))
        .await
        .unwrap();
    assert!(second.seq > ack.sequence);
    let (_w, _stop) = {
        let mut o = env.opts();
        o.kinds = vec!["hark".into()];
        let stop = CancellationToken::new();
        let w = leasehold::Worker::new(o)
            .kind("hark", leasehold_tests::Hark)
            .start(stop.clone())
            .await
            .unwrap();
        (w, stop)
    };
    env.submit(
        "hark",
        json!({"input": {"name": "go", "times": 3}}),
        "hark-kept",
    )
    .await;
    // The first two waits take the kept signals at once; the third waits.
    let waiting = env
        .wait_status("hark-kept", "waiting", Duration::from_secs(10))
        .await;
    assert_eq!(waiting.waiting_step.as_deref(), Some("wait:go#2"));
    assert_eq!(waiting.waiting_after, second.seq);
    let (code, third, err) = signal(&env, "hark-kept", "go", "3").await;
    assert_eq!(code, 0, "{err}");
    let got = got(&env, "hark-kept").await;
    let data: Vec<&Value> = got.iter().map(|g| &g["data"]).collect();
    assert_eq!(data, [&json!("first"), &json!({"n": 2}), &json!(3)]);
    assert_eq!(got[0]["seq"], json!(ack.sequence));
    assert_eq!(
        got[0].get("sender"),
        None,
        "a plain publish names no sender"
    );
    assert_eq!(got[1]["sender"], json!("test"));
    assert_eq!(got[2]["seq"], third["seq"]);
    for step in ["wait:go#0", "wait:go#1", "wait:go#2"] {
        assert_eq!(env.steps_recorded("hark-kept", step).await, 1, "{step}");
    }
    let waits = env.events_of("hark-kept").await;
    assert_eq!(
        waits.iter().filter(|e| e.r#type == "waiting").count(),
        1,
        "only the wait whose signal was not there yet ended an attempt"
    );
    // `leasehold signal ID --list`: the three, in order, and the wait that
    // took each; one more, sent now, taken by none.
    Signals::new(&env.conn)
        .send("hark-kept", "extra", &json!({}), None, None)
        .await
        .unwrap();
    let (code, out, err) = cli(&env.url(), &["signal", "hark-kept", "--list"]).await;
    assert_eq!(code, 0, "{err}");
    let rows: Vec<Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let seen: Vec<(&str, &Value)> = rows
        .iter()
        .map(|r| (r["name"].as_str().unwrap(), &r["taken_by"]))
        .collect();
    assert_eq!(
        seen,
        [
            ("go", &json!("wait:go#0")),
            ("go", &json!("wait:go#1")),
            ("go", &json!("wait:go#2")),
            ("extra", &Value::Null)
        ],
        "{out}"
    );
}

#[tokio::test]
async fn a_timeout_ends_a_wait_with_nothing_and_the_next_wait_takes_a_later_signal() {
    let env = Fleet::with_kind("hark").await;
    let a = env.sdk_worker(&env.url(), "hark-a", "hark");
    wait_log(&a, "worker starting", Duration::from_secs(20)).await;
    env.submit(
        "hark",
        json!({"input": {"name": "nudge", "times": 2, "timeout_ms": 1500}}),
        "hark-late",
    )
    .await;
    let first = env
        .wait_status("hark-late", "waiting", Duration::from_secs(10))
        .await;
    assert!(first.next_run_at.is_some(), "a timeout is a wake-up time");
    // The first wait times out; the second waits again.
    let second = env
        .wait_for("hark-late", Duration::from_secs(15), |r| {
            r.status == "waiting" && r.waiting_step.as_deref() == Some("wait:nudge#1")
        })
        .await;
    assert_eq!(second.waiting_after, 0, "the first wait took nothing");
    let (code, sent, err) = signal(&env, "hark-late", "nudge", r#"{"late": true}"#).await;
    assert_eq!(code, 0, "{err}");
    let got = got(&env, "hark-late").await;
    assert_eq!(got[0], Value::Null, "the first wait timed out");
    assert_eq!(got[1]["data"], json!({"late": true}));
    assert_eq!(got[1]["seq"], sent["seq"]);
}

/// The moment that matters: the owner's step looked for the signal (none
/// yet), and the signal comes while the owner writes its wait. The
/// fleet's signal waker is paused, so that only the owner's own look after
/// its write can wake the job: it does, and the job takes the signal once.
#[tokio::test]
async fn a_signal_sent_while_the_owner_writes_its_wait_wakes_the_job() {
    let env = Fleet::with_kind("hark").await;
    let stream = env.conn.layout.signals_stream();
    let waker = env.conn.layout.signal_wake_consumer();
    let pause = |until: &str| json!({"pause_until": until}).to_string();
    let api = format!("$JS.API.CONSUMER.PAUSE.{stream}.{waker}");
    let r = env
        .conn
        .client
        .request(api.clone(), pause("2099-01-01T00:00:00Z").into())
        .await
        .unwrap();
    let r: Value = serde_json::from_slice(&r.payload).unwrap();
    assert_eq!(r["paused"], json!(true), "{r}");
    let proxy = FaultProxy::start(&env.url()).await;
    let hold = proxy.hold("$KV.lh_active.hold.>");
    let mut a = env.sdk_worker(&proxy.url(), "hark-a", "hark");
    wait_log(&a, "worker starting", Duration::from_secs(20)).await;
    env.submit("hark", json!({"input": {"name": "go"}}), "hark-race")
        .await;
    tokio::time::timeout(Duration::from_secs(15), hold.triggered())
        .await
        .expect("the owner reached the index write after its wait's");
    assert_eq!(env.record("hark-race").await.unwrap().status, "waiting");
    let (code, sent, err) = signal(&env, "hark-race", "go", r#"{"raced": true}"#).await;
    assert_eq!(code, 0, "{err}");
    hold.release();
    let got = got(&env, "hark-race").await;
    assert_eq!(got[0]["data"], json!({"raced": true}));
    assert_eq!(got[0]["seq"], sent["seq"]);
    assert_eq!(env.steps_recorded("hark-race", "wait:go#0").await, 1);
    let info: Value = serde_json::from_slice(
        &env.conn
            .client
            .request(format!("$JS.API.CONSUMER.INFO.{stream}.{waker}"), "".into())
            .await
            .unwrap()
            .payload,
    )
    .unwrap();
    assert_eq!(
        info["num_ack_pending"].as_u64().unwrap_or(0)
            + info["delivered"]["consumer_seq"].as_u64().unwrap_or(0),
        0,
        "the paused waker took no part: {info}"
    );
    a.kill9();
}

/// A signal sent while a dead owner's job is being reclaimed (its record
/// still says running, its session not yet ended) is kept: the next owner's
/// wait takes it without waiting.
#[tokio::test]
async fn a_signal_sent_during_a_reclaim_is_taken_by_the_next_owner() {
    let env = Fleet::with_kind("hark").await;
    let mut a = env.sdk_worker(&env.url(), "hark-a", "hark");
    wait_log(&a, "worker starting", Duration::from_secs(20)).await;
    env.submit(
        "hark",
        json!({"input": {"name": "go", "busy_ms": 60000}}),
        "hark-reclaim",
    )
    .await;
    env.wait_event("hark-reclaim", "step", Duration::from_secs(10))
        .await;
    a.kill9();
    assert_eq!(
        env.record("hark-reclaim").await.unwrap().status,
        "running",
        "its dead owner's record"
    );
    let (code, sent, err) = signal(&env, "hark-reclaim", "go", r#"{"while": "reclaim"}"#).await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(sent["waited_for"], json!(false), "{sent}");
    let _b = env.sdk_worker(&env.url(), "hark-b", "hark");
    let (_r, _stop) = env.reaper().await;
    let done = env
        .wait_status("hark-reclaim", "completed", Duration::from_secs(60))
        .await;
    assert!(done.epoch >= 2, "{done:?}");
    let got = got(&env, "hark-reclaim").await;
    assert_eq!(got[0]["data"], json!({"while": "reclaim"}));
    assert_eq!(env.steps_recorded("hark-reclaim", "wait:go#0").await, 1);
    assert!(
        !env.events_of("hark-reclaim")
            .await
            .iter()
            .any(|e| e.r#type == "waiting"),
        "the kept signal was taken without a wait"
    );
}

#[tokio::test]
async fn bad_signals_are_refused_with_their_reason_and_nothing_is_sent() {
    let env = Fleet::with_kind("hark").await;
    let (_w, _stop) = env.worker().await;
    let signals_stored = || async {
        let mut s = env
            .conn
            .js
            .get_stream(env.conn.layout.signals_stream())
            .await
            .unwrap();
        s.info().await.unwrap().state.messages
    };
    // Bad usage: exit 2, nothing sent.
    let (code, _, err) = cli(&env.url(), &["signal", "some-job", "no.dots"]).await;
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("signal name"), "{err}");
    let (code, _, err) = cli(&env.url(), &["signal", "some-job", "go", "--data", "{nope"]).await;
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("not JSON"), "{err}");
    // No such job, a finished job: exit 1, nothing sent.
    let (code, _, err) = cli(&env.url(), &["signal", "no-such-job", "go"]).await;
    assert_eq!(code, 1);
    assert!(err.contains("no job no-such-job"), "{err}");
    env.submit("echo", json!({"input": {}}), "done-job").await;
    env.wait_status("done-job", "completed", Duration::from_secs(10))
        .await;
    let (code, _, err) = cli(&env.url(), &["signal", "done-job", "go"]).await;
    assert_eq!(code, 1);
    assert!(err.contains("is completed"), "{err}");
    assert_eq!(signals_stored().await, 0, "nothing was sent");
    // A send tried again with its dedupe id stores one signal.
    env.submit("sleep", json!({"input": {"ms": 60000}}), "hark-dedupe")
        .await;
    env.wait_status("hark-dedupe", "running", Duration::from_secs(10))
        .await;
    let mut seqs = Vec::new();
    for _ in 0..2 {
        let (code, out, err) = cli(
            &env.url(),
            &["signal", "hark-dedupe", "go", "--dedupe-id", "mail-4711"],
        )
        .await;
        assert_eq!(code, 0, "{err}");
        let v: Value = serde_json::from_str(out.trim()).unwrap();
        seqs.push((v["seq"].clone(), v["duplicate"].clone()));
    }
    assert_eq!(seqs[0].0, seqs[1].0);
    assert_eq!((&seqs[0].1, &seqs[1].1), (&json!(false), &json!(true)));
    assert_eq!(signals_stored().await, 1);
}

/// The console sends one: a waiting job's page has a *send signal…* button
/// with the name it waits for filled in; the confirmation takes the data
/// (bad JSON is refused, nothing sent), and the job wakes with it.
#[tokio::test]
async fn console_in_a_browser_sends_a_signal_to_a_waiting_job() {
    use crate::console::{spawn_console, Browser};
    let env = Fleet::with_kind("hark").await;
    let w = env.sdk_worker(&env.url(), "hark-a", "hark");
    wait_log(&w, "worker starting", Duration::from_secs(20)).await;
    let console = spawn_console(&env, &[]).await;
    let mut b = Browser::start().await;
    env.submit("hark", json!({"input": {"name": "approval"}}), "hark-ui")
        .await;
    env.wait_status("hark-ui", "waiting", Duration::from_secs(10))
        .await;
    b.goto(&format!("{}/jobs/hark-ui", console.base)).await;
    b.wait(
        "document.querySelector('#waits') && document.querySelector('#waits').innerText.startsWith('for signal `approval`') && document.body.innerText.includes('hark-a for signal `approval`')",
        Duration::from_secs(10),
        "the summary and the waiting event saying what it waits for",
    )
    .await;
    b.click("#signal").await;
    b.wait(
        "document.querySelector('#signal-name') && document.querySelector('#signal-name').value === 'approval'",
        Duration::from_secs(10),
        "the signal's name filled in",
    )
    .await;
    b.eval("document.querySelector('#signal-data').value = '{nope'")
        .await;
    b.click("#confirm").await;
    b.wait(
        "document.body.innerText.includes('the data must be JSON')",
        Duration::from_secs(10),
        "bad data refused",
    )
    .await;
    assert_eq!(env.record("hark-ui").await.unwrap().status, "waiting");
    b.goto(&format!(
        "{}/confirm?action=signal&id=hark-ui&name=approval",
        console.base
    ))
    .await;
    b.eval("document.querySelector('#signal-data').value = '{\"approve\": true}'")
        .await;
    b.confirm("the signal's answer").await;
    let got = got(&env, "hark-ui").await;
    assert_eq!(got[0]["data"], json!({"approve": true}));
    assert_eq!(got[0]["sender"], json!("local via console"));
}
