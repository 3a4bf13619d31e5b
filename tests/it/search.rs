//! Search over the history of finished jobs (issue 35): every way a job
//! ends leaves exactly one entry, a reaper killed -9 mid-stream leaves no
//! gap and no duplicate, and searches by tenant, status and time range find
//! exactly what they should, from the store, the CLI and the console's
//! form in a real browser.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use async_nats::jetstream::consumer;
use futures::StreamExt;
use leasehold::JobRecord;
use leasehold_harness::Proc;
use leasehold_testkit::doors::history::Recovery;
use leasehold_testkit::doors::history::{history, Entry, Query, QueryText};
use leasehold_testkit::doors::reaper::Options as ReaperOptions;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::console::{spawn_console, Browser};
use leasehold_testkit::{cli, wait_log, Fleet};

async fn reaper(env: &Fleet) -> CancellationToken {
    let mut o = ReaperOptions::local(&env.url(), &env.prefix);
    o.interval = Duration::from_millis(300);
    env.reaper_with(o).await.1
}

/// Follows the history stream (an ordered consumer: each entry as it is
/// stored) until it holds `n` entries; all of them by sequence.
async fn wait_history(env: &Fleet, n: usize, timeout: Duration) -> Vec<(u64, Entry)> {
    let s = env
        .conn
        .js
        .get_stream(env.conn.layout.history_stream())
        .await
        .unwrap();
    let c = s
        .create_consumer(consumer::pull::OrderedConfig::default())
        .await
        .unwrap();
    let mut msgs = c.messages().await.unwrap();
    let mut out = Vec::new();
    let deadline = tokio::time::Instant::now() + timeout;
    while out.len() < n {
        let m = tokio::time::timeout_at(deadline, msgs.next())
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "{} history entries of {n} after {timeout:?}: {out:?}",
                    out.len()
                )
            })
            .unwrap()
            .unwrap();
        let seq = m.info().unwrap().stream_sequence;
        out.push((seq, serde_json::from_slice(&m.payload).unwrap()));
    }
    out
}

/// How many entries the stream holds now.
async fn history_len(env: &Fleet) -> u64 {
    let mut s = env
        .conn
        .js
        .get_stream(env.conn.layout.history_stream())
        .await
        .unwrap();
    s.info().await.unwrap().state.messages
}

/// Waits until the historian has nothing left to handle (its consumer has
/// no pending or unacked event), so no entry can still come.
async fn historian_idle(env: &Fleet, timeout: Duration) {
    let s = env
        .conn
        .js
        .get_stream(env.conn.layout.events_stream())
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let mut c: consumer::PullConsumer = s
            .get_consumer(&env.conn.layout.historian_consumer())
            .await
            .unwrap();
        let i = c.info().await.unwrap();
        if i.num_pending == 0 && i.num_ack_pending == 0 {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "historian still busy: {i:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn cancel(env: &Fleet, id: &str) {
    env.conn
        .client
        .request(format!("lh.cancel.{id}"), "".into())
        .await
        .unwrap();
}

fn by_id(entries: &[(u64, Entry)]) -> BTreeMap<String, Entry> {
    entries
        .iter()
        .map(|(_, e)| (e.id.clone(), e.clone()))
        .collect()
}

fn ids(p: &history::Page) -> Vec<String> {
    let mut v: Vec<String> = p.entries.iter().map(|(_, e)| e.id.clone()).collect();
    v.sort();
    v
}

async fn search(env: &Fleet, t: QueryText) -> history::Page {
    let q = Query::parse(&t, SystemTime::now()).unwrap();
    history::search(&env.conn, &q).await.unwrap()
}

/// Now, rounded up to the millisecond (the precision times are written
/// with), once the clock has passed it: what was stored before is before
/// it, what is stored after is after it.
async fn boundary() -> SystemTime {
    let ms = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
        + 1;
    let at = SystemTime::UNIX_EPOCH + Duration::from_millis(ms);
    pass(at).await;
    at
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_way_a_job_ends_leaves_one_entry_and_searches_find_exactly_theirs() {
    let env = Fleet::start().await;
    let stop_r = reaper(&env).await;
    let (w, stop) = env.worker().await;
    // Completed (two tenants), failed (the built-in `fail` kind), rejected
    // (a bad input), cancelled while running, dead-lettered (the recovery's
    // own dead-lettering).
    env.submit("echo", json!({"input": {}, "tenant": "acme"}), "ok-acme")
        .await;
    env.submit("echo", json!({"input": {}}), "ok-default").await;
    env.submit(
        "fail",
        json!({"input": {"class": "terminal", "times": 5}, "tenant": "acme"}),
        "fail-acme",
    )
    .await;
    env.work
        .submit(
            "sleep",
            br#"{"input":{"ms":"soon"}}"#.to_vec().into(),
            Some("rej-1"),
            None,
        )
        .await
        .unwrap();
    env.submit("sleep", json!({"input": {"ms": 60000}}), "cancel-1")
        .await;
    for (id, st) in [
        ("ok-acme", "completed"),
        ("ok-default", "completed"),
        ("fail-acme", "failed"),
        ("rej-1", "rejected"),
    ] {
        env.wait_status(id, st, Duration::from_secs(20)).await;
    }
    env.wait_status("cancel-1", "running", Duration::from_secs(20))
        .await;
    cancel(&env, "cancel-1").await;
    env.wait_status("cancel-1", "cancelled", Duration::from_secs(20))
        .await;
    let dead = JobRecord {
        id: "dead-1".into(),
        kind: "echo".into(),
        status: "dead".into(),
        epoch: 2,
        stale_reclaims: 3,
        created_at: leasehold_testkit::record::now(),
        error: Some(leasehold_proto::JobError {
            class: "poison".into(),
            message: "crashed its workers 3 times".into(),
            ..Default::default()
        }),
        ..Default::default()
    };
    env.jobs.create(&dead).await.unwrap();
    let rec = Recovery::open(&env.conn, "test".into(), 3).await.unwrap();
    rec.finish(&dead, None, None).await.unwrap();

    let all = wait_history(&env, 6, Duration::from_secs(30)).await;
    historian_idle(&env, Duration::from_secs(30)).await;
    assert_eq!(history_len(&env).await, 6, "one entry per end: {all:?}");
    let e = by_id(&all);
    assert_eq!(e.len(), 6, "no job twice: {all:?}");
    let f = &e["fail-acme"];
    assert_eq!(
        (
            f.kind.as_str(),
            f.tenant.as_str(),
            f.status.as_str(),
            f.class.as_str(),
            f.attempts
        ),
        ("fail", "acme", "failed", "terminal", 1)
    );
    assert!(
        !f.created_at.is_empty() && f.ended_at >= f.created_at,
        "{f:?}"
    );
    assert_eq!(
        (
            e["ok-default"].tenant.as_str(),
            e["ok-default"].class.as_str()
        ),
        ("default", "")
    );
    assert_eq!(e["rej-1"].status, "rejected");
    assert_eq!(e["cancel-1"].status, "cancelled");
    assert_eq!(
        (
            e["dead-1"].status.as_str(),
            e["dead-1"].class.as_str(),
            e["dead-1"].epoch
        ),
        ("dead", "poison", 2)
    );

    // Tenant, status, class: exactly theirs, with the server's count.
    let p = search(
        &env,
        QueryText {
            tenant: Some("acme".into()),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(
        (ids(&p), p.matched),
        (vec!["fail-acme".to_string(), "ok-acme".to_string()], 2)
    );
    let p = search(
        &env,
        QueryText {
            status: Some("completed".into()),
            tenant: Some("acme".into()),
            ..Default::default()
        },
    )
    .await;
    assert_eq!((ids(&p), p.matched), (vec!["ok-acme".to_string()], 1));
    let p = search(
        &env,
        QueryText {
            class: Some("none".into()),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(p.matched, 3, "completed twice and cancelled: {p:?}");
    // Paging: a page of 2, then the rest from its cursor; the count is
    // the whole range's on every page.
    let p1 = search(
        &env,
        QueryText {
            limit: Some("2".into()),
            ..Default::default()
        },
    )
    .await;
    assert_eq!((p1.entries.len(), p1.matched), (2, 6));
    let p2 = search(
        &env,
        QueryText {
            limit: Some("10".into()),
            after: Some(p1.next.unwrap().to_string()),
            ..Default::default()
        },
    )
    .await;
    assert_eq!((p2.entries.len(), p2.matched, p2.next), (4, 6, None));
    // An id prefix: read from the entries, the count an upper bound.
    let p = search(
        &env,
        QueryText {
            id_prefix: Some("ok-".into()),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(
        ids(&p),
        vec!["ok-acme".to_string(), "ok-default".to_string()]
    );
    assert!(p.matched_is_upper_bound && p.matched == 6);

    // Time range: the jobs that end between two instants, and only they.
    let t1 = boundary().await;
    env.submit("echo", json!({"input": {}, "tenant": "acme"}), "late-1")
        .await;
    env.submit("echo", json!({"input": {}, "tenant": "acme"}), "late-2")
        .await;
    wait_history(&env, 8, Duration::from_secs(30)).await;
    let t2 = boundary().await;
    env.submit("echo", json!({"input": {}, "tenant": "acme"}), "later")
        .await;
    wait_history(&env, 9, Duration::from_secs(30)).await;
    let at = |t| leasehold_testkit::record::rfc3339(t);
    let p = search(
        &env,
        QueryText {
            tenant: Some("acme".into()),
            since: Some(at(t1)),
            until: Some(at(t2)),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(
        (ids(&p), p.matched),
        (vec!["late-1".to_string(), "late-2".to_string()], 2)
    );

    // The CLI: the same search, its count and the next page's command.
    let (code, out, err) = cli(
        &env.url(),
        &[
            "list",
            "--finished",
            "--tenant",
            "acme",
            "--since",
            &at(t1),
            "--limit",
            "1",
        ],
    )
    .await;
    assert_eq!(code, 0, "{out}{err}");
    // The two end in either order; a page of one shows one of them.
    let first = if out.contains("late-1") {
        "late-1"
    } else {
        "late-2"
    };
    let second = if first == "late-1" {
        "late-2"
    } else {
        "late-1"
    };
    assert!(out.contains(first) && !out.contains(second), "{out}");
    assert!(
        err.contains("3 matched; 1 shown")
            && err.contains("next page: leasehold list --finished --tenant acme --since"),
        "{err}"
    );
    let next = err
        .lines()
        .find_map(|l| l.strip_prefix("next page: leasehold "))
        .unwrap();
    let args: Vec<&str> = next.split(' ').collect();
    let (code, out, err) = cli(&env.url(), &args).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains(second) && !out.contains(first), "{out}");
    let (code, out, _) = cli(
        &env.url(),
        &["list", "--finished", "--status", "failed", "--json"],
    )
    .await;
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(out.lines().next().unwrap()).unwrap();
    assert_eq!(
        (v["id"].as_str(), v["class"].as_str()),
        (Some("fail-acme"), Some("terminal"))
    );
    // Bad queries: clear errors, nothing read.
    for (args, says) in [
        (
            vec!["list", "--finished", "--status", "running"],
            "not a finished status",
        ),
        (
            vec!["list", "--finished", "--since", "last tuesday"],
            "is not a time",
        ),
        (
            vec!["list", "--finished", "--limit", "5000"],
            "from 1 to 1000",
        ),
        (vec!["list", "--tenant", "acme"], "--finished"),
    ] {
        let (code, out, err) = cli(&env.url(), &args).await;
        assert_ne!(code, 0, "{args:?}: {out}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
    // Today's flags keep their behaviour.
    let (code, _, err) = cli(&env.url(), &["list", "--status", "failed"]).await;
    assert_ne!(code, 0);
    assert!(err.contains("--finished") && err.contains("--all"), "{err}");

    stop.cancel();
    w.wait().await.unwrap();
    stop_r.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reaper_killed_mid_stream_leaves_no_gap_and_no_duplicate() {
    let env = Fleet::start().await;
    let (w, stop) = env
        .worker_with({
            let mut o = env.opts();
            o.concurrency = 16;
            o
        })
        .await;
    let n = 300;
    for i in 0..n {
        env.submit("echo", json!({"input": {"i": i}}), &format!("k-{i:03}"))
            .await;
    }
    for i in 0..n {
        env.wait_status(&format!("k-{i:03}"), "completed", Duration::from_secs(60))
            .await;
    }
    let renv = env.proc_env();
    let mut r1 = Proc::spawn("leasehold-reaper", &[], &renv);
    wait_log(&r1, "reaper starting", Duration::from_secs(20)).await;
    // Mid-stream: some entries stored, the rest not yet.
    wait_history(&env, 20, Duration::from_secs(30)).await;
    r1.kill9();
    let stored = history_len(&env).await;
    let r2 = Proc::spawn("leasehold-reaper", &[], &renv);
    wait_log(&r2, "reaper starting", Duration::from_secs(20)).await;
    let all = wait_history(&env, n, Duration::from_secs(60)).await;
    historian_idle(&env, Duration::from_secs(60)).await;
    assert_eq!(
        history_len(&env).await,
        n as u64,
        "no duplicate (killed at {stored} stored)"
    );
    let e = by_id(&all);
    assert_eq!(e.len(), n, "no gap, no job twice");
    assert!(e.values().all(|x| x.status == "completed"));
    drop(r2);
    stop.cancel();
    w.wait().await.unwrap();
}

/// `t` rounded up to a whole second, as the form's time fields take it
/// (UTC, `YYYY-MM-DDTHH:MM:SS`), and that instant.
fn next_second(t: SystemTime) -> (String, SystemTime) {
    let secs = t.duration_since(SystemTime::UNIX_EPOCH).unwrap().as_secs() + 1;
    let at = SystemTime::UNIX_EPOCH + Duration::from_secs(secs);
    let s = leasehold_testkit::record::rfc3339(at);
    (s[..19].to_string(), at)
}

/// Waits for the wall clock to pass `at` (a time boundary, not an event).
async fn pass(at: SystemTime) {
    if let Ok(d) = at.duration_since(SystemTime::now()) {
        tokio::time::sleep(d + Duration::from_millis(2)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_in_a_browser_searches_the_history_by_time_range() {
    let env = Fleet::start().await;
    let stop_r = reaper(&env).await;
    let (w, stop) = env.worker().await;
    let console = spawn_console(&env, &[]).await;
    env.submit("echo", json!({"input": {}}), "before-1").await;
    wait_history(&env, 1, Duration::from_secs(30)).await;
    let (from, from_at) = next_second(SystemTime::now());
    pass(from_at).await;
    for id in ["in-1", "in-2", "in-3"] {
        env.submit("echo", json!({"input": {}}), id).await;
    }
    env.submit(
        "fail",
        json!({"input": {"class": "terminal", "times": 1}}),
        "in-fail",
    )
    .await;
    wait_history(&env, 5, Duration::from_secs(30)).await;
    let (to, to_at) = next_second(SystemTime::now());
    pass(to_at).await;
    env.submit("echo", json!({"input": {}}), "after-1").await;
    wait_history(&env, 6, Duration::from_secs(30)).await;

    let mut b = Browser::start().await;
    b.goto(&format!("{}/jobs", console.base)).await;
    b.wait(
        "document.querySelector('#history-search')",
        Duration::from_secs(10),
        "the search form",
    )
    .await;
    let set = format!(
        "(() => {{ const f = document.querySelector('#history-search'); f.from.value = {from}; f.to.value = {to}; return f.from.value.startsWith({from}.slice(0, 16)) && f.to.value.startsWith({to}.slice(0, 16)); }})()",
        from = json!(from),
        to = json!(to)
    );
    assert_eq!(
        b.eval(&set).await,
        json!(true),
        "the form takes {from} .. {to}"
    );
    b.click("#history-search button").await;
    b.wait(
        "document.querySelector('#history-count')",
        Duration::from_secs(20),
        "the results",
    )
    .await;
    let count = b
        .eval("document.querySelector('#history-count').innerText")
        .await;
    assert_eq!(count, json!("4 matched"));
    let rows = b
        .eval(
            "[...document.querySelectorAll('#history tr')].map(r => r.dataset.id).sort().join(',')",
        )
        .await;
    assert_eq!(rows, json!("in-1,in-2,in-3,in-fail"));
    let failed = b
        .eval("document.querySelector('#history tr[data-id=\"in-fail\"] .status').innerText")
        .await;
    assert_eq!(failed, json!("failed"));
    // The form kept the range; a bad one is a clear 400 page.
    let kept = b
        .eval("document.querySelector('#history-search').from.value")
        .await;
    assert!(
        kept.as_str().unwrap_or("").starts_with(&from[..16]),
        "{kept}"
    );
    let r = crate::console::http()
        .get(format!("{}/history?from=yesterday-ish", console.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert!(r.text().await.unwrap().contains("is not a time"));
    let r = crate::console::http()
        .get(format!("{}/history?status=running", console.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);

    stop.cancel();
    w.wait().await.unwrap();
    stop_r.cancel();
}
