//! Submissions: id rules, dedupe, JSON and protobuf, and every bad input.

use std::time::Duration;

use async_nats::HeaderMap;
use futures::StreamExt;
use prost::Message as _;
use serde_json::json;

use leasehold_testkit::Fleet;

#[tokio::test]
async fn ids_dedupe_and_protobuf() {
    let env = Fleet::start().await;
    let (w, stop) = env.worker().await;
    // Header id; the same id twice is one job.
    env.submit("echo", json!({"input": {"x": 1}}), "dup").await;
    let again = env
        .work
        .submit(
            "echo",
            json!({"input": {"x": 2}}).to_string().into(),
            Some("dup"),
            None,
        )
        .await
        .unwrap();
    assert!(
        again.duplicate,
        "the stream's dedupe window recognises the id"
    );
    let r = env
        .wait_status("dup", "completed", Duration::from_secs(10))
        .await;
    assert_eq!(
        serde_json::to_value(r.result.unwrap()).unwrap()["output"],
        json!({"x": 1})
    );
    // Spec id, then sequence-derived id.
    env.work
        .submit(
            "echo",
            json!({"id": "from-spec", "input": {}}).to_string().into(),
            None,
            None,
        )
        .await
        .unwrap();
    env.wait_status("from-spec", "completed", Duration::from_secs(10))
        .await;
    let p = env
        .work
        .submit("echo", json!({"input": {}}).to_string().into(), None, None)
        .await
        .unwrap();
    env.wait_status(
        &format!("seq-{}", p.seq),
        "completed",
        Duration::from_secs(10),
    )
    .await;
    // Protobuf.
    let spec = leasehold_proto::JobSpec {
        input: r#"{"pb":true}"#.into(),
        ..Default::default()
    };
    env.work
        .submit(
            "echo",
            spec.encode_to_vec().into(),
            Some("pb"),
            Some("application/protobuf"),
        )
        .await
        .unwrap();
    let r = env
        .wait_status("pb", "completed", Duration::from_secs(10))
        .await;
    assert_eq!(
        serde_json::to_value(r.result.unwrap()).unwrap()["output"],
        json!({"pb": true})
    );
    // Beyond the dedupe window the record's existence still makes it one job:
    // a late duplicate ticket of a completed job is dropped, not re-run.
    env.ticket("echo", json!({"input": {"x": 3}}), "dup2").await;
    env.wait_status("dup2", "completed", Duration::from_secs(10))
        .await;
    let late = leasehold_testkit::record::new_record(
        "dup2",
        "echo",
        Default::default(),
        0,
        std::time::SystemTime::now(),
    );
    let p = env
        .work
        .reissue(&late, "late-duplicate", "1")
        .await
        .unwrap();
    assert!(!p.duplicate);
    env.wait_for("dup2", Duration::from_secs(10), |r| r.status == "completed")
        .await;
    // The late ticket is acked away without a second claim.
    let stream = env.conn.js.get_stream("LH_WORK").await.unwrap();
    let mut info = stream;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while info.info().await.unwrap().state.messages > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "tickets left in the work stream"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(env.record("dup2").await.unwrap().epoch, 1);
    stop.cancel();
    w.wait().await.unwrap();
}

/// One bad submission: raw bytes, an id header, the expected error text.
struct Bad {
    kind: &'static str,
    payload: Vec<u8>,
    id: Option<&'static str>,
    expect: &'static str,
}

#[tokio::test]
async fn every_bad_submission_is_rejected_precisely_and_kept() {
    let env = Fleet::start().await;
    let (w, stop) = env
        .worker_with({
            let mut o = env.opts();
            o.max_submission_bytes = 4096;
            o
        })
        .await;
    let cases = vec![
        Bad {
            kind: "echo",
            payload: b"not json".to_vec(),
            id: Some("bad-notjson"),
            expect: "not JSON",
        },
        Bad {
            kind: "echo",
            payload: b"[1,2,3]".to_vec(),
            id: Some("bad-shape"),
            expect: "wrong shape",
        },
        Bad {
            kind: "sleep",
            payload: br#"{"input":{"ms":"soon"}}"#.to_vec(),
            id: Some("bad-type"),
            expect: "input.ms",
        },
        Bad {
            kind: "echo",
            payload: br#"{"input":{},"budget":{"max_steps":"x"}}"#.to_vec(),
            id: Some("bad-type2"),
            expect: "budget.max_steps",
        },
        Bad {
            kind: "echo",
            payload: Vec::new(),
            id: Some("bad-empty"),
            expect: "empty submission",
        },
        Bad {
            kind: "echo",
            payload: vec![b' '; 5000],
            id: Some("bad-large"),
            expect: "over the limit of 4096",
        },
        Bad {
            kind: "echo",
            payload: br#"{"input":{},"budget":{"max_cost_usd":-1}}"#.to_vec(),
            id: Some("bad-budget"),
            expect: "out of range",
        },
        Bad {
            kind: "echo",
            payload: b"{\"input\":{\"a\":\"\xff\"}}".to_vec(),
            id: Some("bad-utf8"),
            expect: "not valid UTF-8",
        },
        Bad {
            kind: "nosuchkind",
            payload: br#"{"input":{}}"#.to_vec(),
            id: Some("bad-kind"),
            expect: "unknown kind",
        },
        Bad {
            kind: "echo",
            payload: b"garbage without id".to_vec(),
            id: None,
            expect: "not JSON",
        },
    ];
    for c in &cases {
        let mut h = HeaderMap::new();
        if let Some(id) = c.id {
            h.insert("Nats-Msg-Id", id);
        }
        env.conn
            .client
            .publish_with_headers(format!("lh.submit.{}", c.kind), h, c.payload.clone().into())
            .await
            .unwrap();
    }
    env.conn.client.flush().await.unwrap();
    for c in cases.iter().filter(|c| c.id.is_some()) {
        let id = c.id.unwrap();
        let r = env
            .wait_status(id, "rejected", Duration::from_secs(10))
            .await;
        let err = r.error.unwrap();
        assert_eq!(err.class, "rejected");
        assert!(
            err.message.contains(c.expect),
            "{id}: {:?} should mention {:?}",
            err.message,
            c.expect
        );
    }
    // The raw bytes are kept byte for byte in lh.dlq.<kind>.
    let dlq = leasehold_testkit::doors::dlq::Dlq::new(&env.conn);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let letters = loop {
        let l = dlq.list().await.unwrap();
        if l.len() >= cases.len() {
            break l;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "only {} dead letters",
            l.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(letters.len(), cases.len());
    for c in &cases {
        let l = letters
            .iter()
            .find(|l| {
                (l.job_id.as_deref() == c.id
                    || (c.id.is_none()
                        && l.job_id.as_deref().is_some_and(|j| j.starts_with("seq-"))))
                    && l.kind == c.kind
                    && l.payload.as_ref() == c.payload.as_slice()
            })
            .unwrap_or_else(|| panic!("no dead letter with the raw bytes of {:?}", c.id));
        assert_eq!(l.class, "rejected");
        assert!(
            l.reason.contains(c.expect) || c.kind == "nosuchkind",
            "{}",
            l.reason
        );
    }
    // The worker kept running and nothing else was affected.
    env.submit("echo", json!({"input": {}}), "after-bad").await;
    env.wait_status("after-bad", "completed", Duration::from_secs(10))
        .await;
    // Counted once, in the worker's metrics, which the snapshot reads.
    assert_eq!(w.metrics.total(leasehold::Count::Rejected), 9);
    let scrape = w.metrics.encode();
    for line in [
        "leasehold_jobs_rejected_total{kind=\"echo\"} 8",
        "leasehold_jobs_rejected_total{kind=\"sleep\"} 1",
    ] {
        assert!(scrape.contains(line), "{line} not in\n{scrape}");
    }
    stop.cancel();
    w.wait().await.unwrap();
}

#[tokio::test]
async fn request_reply_submitters_get_the_error_in_the_reply() {
    let env = Fleet::start().await;
    let (w, stop) = env.worker().await;
    // Unknown kind: nothing stores it, so the gateway's error is the reply.
    let reply = env
        .conn
        .client
        .request("lh.submit.nosuch", br#"{"input":{}}"#.to_vec().into())
        .await
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&reply.payload).unwrap();
    assert!(
        v["error"]["description"]
            .as_str()
            .unwrap()
            .contains("unknown kind \"nosuch\""),
        "{v}"
    );
    // Known kind, bad body: the stream's ack first, then the precise error.
    let inbox = env.conn.client.new_inbox();
    let mut sub = env.conn.client.subscribe(inbox.clone()).await.unwrap();
    let mut h = HeaderMap::new();
    h.insert("Nats-Msg-Id", "rr-bad");
    env.conn
        .client
        .publish_with_reply_and_headers(
            "lh.submit.sleep",
            inbox,
            h,
            br#"{"input":{"ms":-5}}"#.to_vec().into(),
        )
        .await
        .unwrap();
    let mut replies = Vec::new();
    for _ in 0..2 {
        let m = tokio::time::timeout(Duration::from_secs(5), sub.next())
            .await
            .unwrap()
            .unwrap();
        replies.push(serde_json::from_slice::<serde_json::Value>(&m.payload).unwrap());
    }
    assert!(
        replies.iter().any(|r| r["stream"] == "LH_WORK"),
        "{replies:?}"
    );
    let err = replies
        .iter()
        .find(|r| r.get("error").is_some())
        .expect("an error reply");
    assert!(
        err["error"]["description"]
            .as_str()
            .unwrap()
            .contains("input.ms"),
        "{err}"
    );
    assert_eq!(err["id"], "rr-bad");
    env.wait_status("rr-bad", "rejected", Duration::from_secs(10))
        .await;
    stop.cancel();
    w.wait().await.unwrap();
}

#[tokio::test]
async fn a_full_work_queue_refuses_with_a_clear_error_and_loses_nothing() {
    let env = Fleet::with(leasehold_testkit::SetupOptions {
        ack_wait: leasehold_testkit::ACK_WAIT,
        work_max_msgs: 3,
        ..Default::default()
    })
    .await;
    let cli = |args: Vec<String>| {
        let url = env.url();
        async move {
            let out = tokio::process::Command::new(leasehold_harness::bin_path("leasehold"))
                .args(&args)
                .env("NATS_URL", url)
                .output()
                .await
                .unwrap();
            (
                out.status.code().unwrap_or(-1),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            )
        }
    };
    for i in 0..3 {
        let (code, err) = cli(vec![
            "submit".into(),
            "echo".into(),
            r#"{"input":{}}"#.into(),
            "--id".into(),
            format!("q-{i}"),
        ])
        .await;
        assert_eq!(code, 0, "{err}");
    }
    let (code, err) = cli(vec![
        "submit".into(),
        "echo".into(),
        r#"{"input":{}}"#.into(),
        "--id".into(),
        "q-3".into(),
    ])
    .await;
    assert_eq!(code, 75, "a full queue is a temporary failure: {err}");
    assert!(
        err.contains("work queue is full") && err.contains("nothing was submitted"),
        "{err}"
    );
    // A plain NATS client asking for the publish ack gets the server's refusal.
    let mut h = HeaderMap::new();
    h.insert("Nats-Msg-Id", "q-4");
    let reply = env
        .conn
        .client
        .request_with_headers("lh.submit.echo", h, r#"{"input":{}}"#.into())
        .await
        .unwrap();
    let body = String::from_utf8_lossy(&reply.payload);
    assert!(body.contains("maximum messages exceeded"), "{body}");
    // Nothing accepted was lost: a worker runs the three.
    let (w, stop) = env.worker().await;
    for i in 0..3 {
        env.wait_status(&format!("q-{i}"), "completed", Duration::from_secs(15))
            .await;
    }
    assert!(env.jobs.get("q-3").await.unwrap().is_none());
    stop.cancel();
    w.wait().await.unwrap();
}

#[tokio::test]
async fn leaseholds_own_tickets_get_the_streams_ack_never_the_gateways_answer() {
    // A re-issued ticket whose spec the gateway would refuse (here: no input)
    // is published by leasehold itself, which waits for the stream's ack on
    // the same inbox: the gateway must stay silent, or its answer races the
    // ack (a quarter of the time, before this was fixed).
    let env = Fleet::start().await;
    let (w, stop) = env.worker().await;
    for i in 0..40 {
        let rec = leasehold_testkit::record::new_record(
            &format!("own-{i}"),
            "echo",
            Default::default(),
            0,
            std::time::SystemTime::now(),
        );
        let p = env.work.reissue(&rec, "test", "1").await;
        assert!(p.is_ok(), "attempt {i}: {p:?}");
    }
    stop.cancel();
    w.wait().await.unwrap();
}

// Issue 18: a kind set up while the fleet runs. The gateway read the work
// stream's subjects once at start, so an older worker's gateway (one of
// the queue group) rejected the new kind's submissions as `unknown_kind`
// although the stream stored them.
#[tokio::test]
async fn a_kind_set_up_on_a_running_fleet_is_accepted_by_every_gateway() {
    let only_echo = leasehold_testkit::SetupOptions {
        kinds: vec!["echo".into()],
        ..leasehold_testkit::SetupOptions::default()
    };
    let env = Fleet::with(only_echo.clone()).await;
    let mut o = env.opts();
    o.kinds = vec!["echo".into()];
    let (echo_w, stop_echo) = env.worker_with(o).await;
    // Its gateway has seen a submission (and so the subjects) already.
    env.submit("echo", json!({"input": {}}), "before").await;
    env.wait_status("before", "completed", Duration::from_secs(10))
        .await;
    let both = leasehold_testkit::SetupOptions {
        kinds: vec!["echo".into(), "sleep".into()],
        ..only_echo
    };
    leasehold_testkit::doors::layout::ensure(&env.conn, &both)
        .await
        .unwrap();
    let mut o = env.opts();
    o.kinds = vec!["sleep".into()];
    let (sleep_w, stop_sleep) = env.worker_with(o).await;
    for i in 0..20 {
        env.submit("sleep", json!({"input": {"ms": 10}}), &format!("live-{i}"))
            .await;
    }
    for i in 0..20 {
        let r = env
            .wait_for(&format!("live-{i}"), Duration::from_secs(20), |r| {
                r.status == "completed" || r.status == "rejected"
            })
            .await;
        assert_eq!(r.status, "completed", "live-{i}: {:?}", r.error);
    }
    stop_echo.cancel();
    stop_sleep.cancel();
    echo_w.wait().await.unwrap();
    sleep_w.wait().await.unwrap();
}

// Issue 18: retry tickets were deduped by `<id>:retry:<epoch>`, which a job
// id reused after retention repeats (its epochs start again): within the
// dedupe window the new job's retry ticket was swallowed.
#[tokio::test]
async fn a_reissued_ticket_is_deduped_per_incarnation_of_its_id() {
    let env = Fleet::start().await;
    let t = std::time::SystemTime::now();
    let earlier = leasehold_testkit::record::new_record(
        "again",
        "echo",
        Default::default(),
        1,
        t - Duration::from_secs(60),
    );
    let later = leasehold_testkit::record::new_record("again", "echo", Default::default(), 1, t);
    let a = env.work.reissue(&earlier, "retry", "1").await.unwrap();
    let rerun = env.work.reissue(&earlier, "retry", "1").await.unwrap();
    assert!(
        rerun.duplicate && rerun.seq == a.seq,
        "the same step again is one ticket"
    );
    let b = env.work.reissue(&later, "retry", "1").await.unwrap();
    assert!(
        !b.duplicate && b.seq != a.seq,
        "another incarnation's retry is its own ticket"
    );
}

// Issue 24: a kind known to the binary but not set up was refused with the
// compiled-in list of kinds, and left a dead letter (and a `rejected`
// record holding the id) for a submission refused to its face.
#[tokio::test]
async fn a_kind_not_set_up_is_refused_with_the_kinds_set_up_and_keeps_nothing() {
    let env = Fleet::with(leasehold_testkit::SetupOptions {
        kinds: vec!["echo".into()],
        ..leasehold_testkit::SetupOptions::default()
    })
    .await;
    let mut o = env.opts();
    o.kinds = vec!["echo".into()];
    let (w, stop) = env.worker_with(o).await;
    let out = tokio::process::Command::new(leasehold_harness::bin_path("leasehold"))
        .args([
            "submit",
            "sleep",
            r#"{"input":{"ms":1}}"#,
            "--id",
            "not-set-up",
        ])
        .env("NATS_URL", env.url())
        .output()
        .await
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(0), "{err}");
    assert!(
        err.contains("unknown kind \"sleep\"")
            && err.contains("runs echo")
            && !err.contains("crash"),
        "the kinds set up, not the compiled-in list: {err}"
    );
    assert!(
        env.jobs.get("not-set-up").await.unwrap().is_none(),
        "no record holds the id"
    );
    let letters = leasehold_testkit::doors::dlq::Dlq::new(&env.conn)
        .list()
        .await
        .unwrap();
    assert!(letters.is_empty(), "no dead letter: {letters:?}");
    stop.cancel();
    w.wait().await.unwrap();
}

// Issue 30, G20: the gateway listened on `lh.submit.*` only, so a plain
// publish on a lane subject of a kind no stream holds
// (`lh.submit.<unknown>.<tenant>.<priority>`) reached nobody and vanished.
#[tokio::test]
async fn an_unknown_kind_on_a_lane_subject_is_rejected_and_its_bytes_kept() {
    let env = Fleet::start().await;
    let (w, stop) = env.worker().await;
    let cases = [
        ("lh.submit.nosuchkind.acme.2", Some("lane-kind")),
        (
            "lh.submit.nosuchkind.acme.notapriority",
            Some("lane-kind-2"),
        ),
        ("lh.submit.alsonot.globex.0", None),
    ];
    for (subject, id) in &cases {
        let mut h = HeaderMap::new();
        if let Some(id) = id {
            h.insert("Nats-Msg-Id", *id);
        }
        let payload = json!({"input": {"on": subject}}).to_string();
        env.conn
            .client
            .publish_with_headers(subject.to_string(), h, payload.into())
            .await
            .unwrap();
    }
    env.conn.client.flush().await.unwrap();
    for id in cases.iter().filter_map(|c| c.1) {
        let r = env
            .wait_status(id, "rejected", Duration::from_secs(10))
            .await;
        let err = r.error.unwrap();
        assert!(err.message.contains("unknown kind"), "{id}: {err:?}");
    }
    // Every one is a dead letter carrying its bytes.
    let dlq = leasehold_testkit::doors::dlq::Dlq::new(&env.conn);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let letters = loop {
        let l = dlq.list().await.unwrap();
        if l.len() >= cases.len() {
            break l;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} dead letters of {}: {l:?}",
            l.len(),
            cases.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(letters.len(), cases.len(), "{letters:?}");
    for (subject, id) in &cases {
        let payload = json!({"input": {"on": subject}}).to_string();
        let l = letters
            .iter()
            .find(|l| l.payload.as_ref() == payload.as_bytes())
            .unwrap_or_else(|| panic!("no dead letter with the bytes sent on {subject}"));
        assert_eq!(l.class, "rejected");
        if let Some(id) = id {
            assert_eq!(l.job_id.as_deref(), Some(*id));
        }
    }
    // A lane of a kind that is set up, seen by the gateway now too, runs.
    env.submit(
        "echo",
        json!({"input": {"lane": true}, "tenant": "acme", "priority": 2}),
        "lane-ok",
    )
    .await;
    env.wait_status("lane-ok", "completed", Duration::from_secs(10))
        .await;
    stop.cancel();
    w.wait().await.unwrap();
}

/// A spec `leasehold submit` accepts but the fleet refuses (here: over the
/// workers' `--max-submission-bytes`, under the command's own limit) is an
/// error at once, exit 2 with the fleet's reason, not a silent success; the
/// job is still recorded rejected and its bytes kept as a dead letter.
#[tokio::test]
async fn a_submission_the_fleet_refuses_fails_the_submit_command_with_its_reason() {
    let env = Fleet::start().await;
    let mut o = env.opts();
    o.max_submission_bytes = 64;
    let (_w, stop) = env.worker_with(o).await;
    let big = json!({"input": {"text": "x".repeat(200)}}).to_string();
    let (code, out, err) = leasehold_testkit::cli(
        &env.url(),
        &["submit", "echo", &big, "--id", "too-big-for-the-fleet"],
    )
    .await;
    assert_eq!(code, 2, "{out}{err}");
    assert!(
        err.contains("the fleet refused job too-big-for-the-fleet") && err.contains("64"),
        "the reason, with the fleet's limit: {err}"
    );
    let r = env
        .wait_status("too-big-for-the-fleet", "rejected", Duration::from_secs(10))
        .await;
    assert!(r.error.is_some(), "{r:?}");
    // The moment a CI run met: the worker's pull takes the ticket (and
    // refuses it) before the command's question on `lh.enqueued.<seq>` is
    // answered, which then finds the record there or the ticket gone. The
    // command's question is held back until the worker recorded the
    // rejection: the command still fails with the fleet's reason.
    let proxy = leasehold_harness::FaultProxy::start(&env.url()).await;
    let held = proxy.hold("lh.enqueued.*");
    let url = proxy.url();
    let cmd = tokio::spawn(async move {
        leasehold_testkit::cli(&url, &["submit", "echo", &big, "--id", "refused-first"]).await
    });
    tokio::time::timeout(Duration::from_secs(15), held.triggered())
        .await
        .expect("the command asked on lh.enqueued");
    env.wait_status("refused-first", "rejected", Duration::from_secs(10))
        .await;
    held.release();
    let (code, out, err) = cmd.await.unwrap();
    assert_eq!(code, 2, "{out}{err}");
    assert!(
        err.contains("the fleet refused job refused-first") && err.contains("64"),
        "the reason, with the fleet's limit: {err}"
    );
    stop.cancel();
}
