//! The reaper: poison jobs, max deliveries, stranded runs, two replicas at
//! once, and the operators' `dlq` and `review` commands, against a real
//! nats-server with real worker processes where a process has to die.

use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime};

use async_nats::jetstream::AckKind;
use futures::StreamExt;
use leasehold_harness::{bin_path, wait_for_jetstream, Proc};
use leasehold_testkit::doors::dlq::Dlq;
use leasehold_testkit::doors::owner::machine;
use leasehold_testkit::doors::reaper::Handle;
use leasehold_testkit::record::rfc3339;
use leasehold_testkit::record::{JobRecord, JobSpec};
use leasehold_testkit::SetupOptions;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use leasehold_testkit::{Fleet, ACK_WAIT};

async fn stop_reaper((h, stop): (Handle, CancellationToken)) {
    stop.cancel();
    h.wait().await.unwrap();
}

fn spec(input: serde_json::Value) -> JobSpec {
    JobSpec {
        input: input.to_string(),
        ..Default::default()
    }
}

/// A record as a worker that died long ago would have left it.
fn abandoned(
    id: &str,
    kind: &str,
    input: serde_json::Value,
    ticket_seq: u64,
    stale_reclaims: u32,
) -> JobRecord {
    let past = SystemTime::now() - Duration::from_secs(30);
    let mut r = machine::new_record(id, kind, spec(input), ticket_seq, past);
    r.spec.as_mut().unwrap().id = Some(id.into());
    r.status = "running".into();
    r.worker_id = Some("gone".into());
    r.claim_token = Some("token".into());
    r.epoch = u64::from(stale_reclaims) + 1;
    r.stale_reclaims = stale_reclaims;
    r.lease_expires_at = Some(rfc3339(past + Duration::from_secs(2)));
    r
}

async fn dead_events_of(env: &Fleet, id: &str) -> usize {
    env.events_of(id)
        .await
        .iter()
        .filter(|e| e.r#type == "dead")
        .count()
}

/// Runs the CLI; returns (exit code, stdout, stderr).
async fn cli(env: &Fleet, args: &[&str]) -> (i32, String, String) {
    let out = tokio::process::Command::new(bin_path("leasehold"))
        .args(args)
        .env("NATS_URL", env.url())
        .env("LH_PREFIX", &env.prefix)
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn stranded_running_and_queued_jobs_are_reenqueued_and_complete() {
    let env = Fleet::start().await;
    // A running record whose worker and ticket are both gone (ticket 4242
    // never existed), and a queued record that never had a ticket.
    env.seed_record(&abandoned("stranded-run", "echo", json!({"n": 1}), 4242, 0))
        .await;
    let mut q = machine::new_record(
        "stranded-queued",
        "echo",
        spec(json!({"n": 2})),
        0,
        SystemTime::now() - Duration::from_secs(30),
    );
    q.spec.as_mut().unwrap().id = Some("stranded-queued".into());
    env.seed_record(&q).await;
    // The worker starts once both are re-offered: one that took the
    // running job's new ticket before the reaper's record write would
    // reclaim the job itself, and the reaper would count no recovery.
    let r = env.reaper().await;
    let mut m = r.0.metrics_watch();
    tokio::time::timeout(Duration::from_secs(15), async {
        while r.0.stats.recoveries.load(Ordering::Relaxed) < 2 {
            m.changed().await.unwrap();
        }
    })
    .await
    .expect("both re-offered within 15 s");
    let (w, stop_w) = env.worker().await;
    let run = env
        .wait_status("stranded-run", "completed", Duration::from_secs(15))
        .await;
    let queued = env
        .wait_status("stranded-queued", "completed", Duration::from_secs(15))
        .await;
    assert_eq!(run.result.unwrap().output, json!({"n": 1}).to_string());
    assert_eq!(queued.result.unwrap().output, json!({"n": 2}).to_string());
    // The running one was a stale reclaim; the queued one an ordinary claim.
    assert_eq!((run.stale_reclaims, queued.stale_reclaims), (1, 0));
    assert!(run.ticket_seq > 0 && run.ticket_seq != 4242);
    for id in ["stranded-run", "stranded-queued"] {
        let recovered = env
            .events_of(id)
            .await
            .into_iter()
            .filter(|e| {
                e.r#type == "progress" && e.data_map().get("recovered") == Some(&json!(true))
            })
            .count();
        assert_eq!(
            recovered,
            1,
            "{id}: one recovery event: {:#?}",
            env.events_of(id).await
        );
    }
    assert_eq!(r.0.stats.recoveries.load(Ordering::Relaxed), 2);
    stop_reaper(r).await;
    stop_w.cancel();
    w.wait().await.unwrap();
}

/// The sweep follows a live view of the index (a watch): cut by a kill -9
/// of the server, the watch is read again, and a job stranded after the
/// restart (an entry the reaper's view never had) is recovered once.
#[tokio::test]
async fn a_reaper_whose_view_of_the_index_was_cut_by_a_server_kill_still_recovers() {
    let mut env = Fleet::start().await;
    let r = env.reaper().await;
    let mut sweeps = r.0.metrics_watch();
    sweeps
        .wait_for(|m| m.sweeps >= 1)
        .await
        .expect("the reaper sweeps");
    env.server.kill();
    env.server.restart();
    wait_for_jetstream(&env.url(), Duration::from_secs(20)).await;
    env.seed_record(&abandoned("after-cut", "echo", json!({"n": 7}), 4242, 0))
        .await;
    let (w, stop_w) = env.worker().await;
    let done = env
        .wait_status("after-cut", "completed", Duration::from_secs(30))
        .await;
    assert_eq!(
        done.result.as_ref().unwrap().output,
        json!({"n": 7}).to_string()
    );
    assert_eq!(done.stale_reclaims, 1, "one re-offer: {done:#?}");
    assert_eq!(r.0.stats.recoveries.load(Ordering::Relaxed), 1);
    // The view counts it gone once its entry was removed.
    let gone = tokio::time::timeout(
        Duration::from_secs(10),
        sweeps.wait_for(|m| m.jobs == 0 && m.sweeps > 1),
    )
    .await;
    assert!(gone.is_ok(), "the reaper still counts {:?}", r.0.metrics());
    stop_reaper(r).await;
    stop_w.cancel();
    w.wait().await.unwrap();
}

/// A reaper follows the sessions and the schedules with one watch each:
/// sweeps, probes and schedule checks (several a second here) read none of
/// them and make no consumer (only a look while a view is still being read
/// lists its bucket), and a sweep still counts the live sessions, a
/// worker's start and end included.
#[tokio::test]
async fn a_reapers_sweeps_probes_and_checks_make_no_consumer() {
    let env = Fleet::start().await;
    let mut o = env.reaper_opts();
    o.interval = Duration::from_millis(100);
    o.probe_interval = Duration::from_millis(100);
    let r = env.reaper_with(o).await;
    let mut sweeps = r.0.metrics_watch();
    sweeps
        .wait_for(|m| m.sweeps >= 1 && m.sessions == 0)
        .await
        .expect("the reaper sweeps");
    let (w, stop_w) = env.worker().await;
    sweeps
        .wait_for(|m| m.sessions == 1)
        .await
        .expect("the sweep counts the worker's session");
    let consumers = |bucket: String| {
        let js = env.conn.js.clone();
        async move {
            let s = js.get_stream(format!("KV_{bucket}")).await.unwrap();
            let names: Vec<String> = s.consumer_names().map(Result::unwrap).collect().await;
            names
        }
    };
    let layout = &env.conn.layout;
    let count = || async {
        (
            consumers(layout.sessions_bucket()).await,
            consumers(layout.schedules_bucket()).await,
        )
    };
    // Twice twenty sweeps (and as many probes and checks): the consumers
    // do not grow with them. Only while a view is being read (at the
    // start, on a loaded machine) does a look list its bucket once.
    let mut seen = Vec::new();
    for _ in 0..2 {
        let from = r.0.metrics().sweeps;
        sweeps
            .wait_for(|m| m.sweeps >= from + 20)
            .await
            .expect("twenty more sweeps");
        seen.push(count().await);
    }
    let (sessions, schedules) = &seen[1];
    assert!(
        sessions.len() <= seen[0].0.len() && schedules.len() <= seen[0].1.len(),
        "consumers grew with the sweeps: {seen:?}"
    );
    assert!(
        sessions.contains(&"lh_session_ends".to_string()) && sessions.len() <= 3,
        "the shared consumer of ended sessions, the reaper's watch (and one listing at its start): {sessions:?}"
    );
    assert!(
        !schedules.is_empty() && schedules.len() <= 2,
        "the reaper's watch (and one listing at its start): {schedules:?}"
    );
    stop_w.cancel();
    w.wait().await.unwrap();
    sweeps
        .wait_for(|m| m.sessions == 0)
        .await
        .expect("the sweep counts the worker's session gone");
    stop_reaper(r).await;
}

#[tokio::test]
async fn ticket_past_max_deliveries_is_dead_lettered_once() {
    let env = Fleet::with(SetupOptions {
        ack_wait: ACK_WAIT,
        max_deliver: 2,
        ..SetupOptions::default()
    })
    .await;
    let r = env.reaper().await;
    // One job never claimed (no record), one with a queued record: no
    // worker runs; a test consumer NAKs each ticket until the server gives up.
    env.submit("echo", json!({"input": {"n": 1}}), "md-unclaimed")
        .await;
    let t2 = env
        .ticket("echo", json!({"input": {"n": 2}}), "md-queued")
        .await;
    env.jobs
        .create(&machine::new_record(
            "md-queued",
            "echo",
            spec(json!({"n": 2})),
            t2,
            SystemTime::now(),
        ))
        .await
        .unwrap();
    // The server notices max deliveries when it would deliver again, so
    // the NAKing consumer keeps pulling, as a fleet of workers would.
    let consumer = env.work.consumer("echo").await.unwrap();
    let naker_stop = CancellationToken::new();
    let naker = {
        let stop = naker_stop.clone();
        tokio::spawn(async move {
            let mut naks = 0;
            while !stop.is_cancelled() {
                let mut batch = consumer
                    .batch()
                    .max_messages(2)
                    .expires(Duration::from_millis(300))
                    .messages()
                    .await
                    .unwrap();
                while let Some(Ok(m)) = batch.next().await {
                    m.ack_with(AckKind::Nak(None)).await.unwrap();
                    naks += 1;
                }
            }
            naks
        })
    };
    // A waiting job is never dead-lettered for its ticket's deliveries: it
    // gets a fresh ticket, the old one deleted.
    let fresh = env
        .wait_for("md-queued", Duration::from_secs(10), |r| {
            r.status == "queued" && r.ticket_seq > t2
        })
        .await;
    for id in ["md-unclaimed"] {
        let rec = env.wait_status(id, "dead", Duration::from_secs(10)).await;
        assert_eq!(rec.error.as_ref().unwrap().class, "max_deliveries", "{id}");
        // The dead event is published last: once it is there, all is done.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while dead_events_of(&env, id).await == 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{id}: no dead event"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let letters = env.letters_of(id).await;
        assert_eq!(letters.len(), 1, "{id}: exactly one dead letter");
        assert_eq!(letters[0].class, "max_deliveries");
        let body: serde_json::Value = serde_json::from_slice(&letters[0].payload).unwrap();
        assert_eq!(body["record"]["status"], "dead");
        assert!(
            body["ticket"].as_str().unwrap().contains("\"n\""),
            "the ticket payload is kept: {body}"
        );
    }
    naker_stop.cancel();
    assert!(
        naker.await.unwrap() >= 4,
        "each ticket was delivered max_deliver (2) times"
    );
    assert!(
        env.work.get(1).await.unwrap().is_none() && env.work.get(t2).await.unwrap().is_none(),
        "tickets deleted"
    );
    // The waiting job runs from its fresh ticket once a worker comes.
    let (_w, stop) = env.worker().await;
    let done = env
        .wait_status("md-queued", "completed", Duration::from_secs(15))
        .await;
    assert!(done.ticket_seq >= fresh.ticket_seq);
    stop.cancel();
    let mut m = r.0.metrics_watch();
    for _ in 0..3 {
        m.changed().await.unwrap();
    }
    assert!(
        env.letters_of("md-queued").await.is_empty(),
        "never dead-lettered"
    );
    assert_eq!(
        r.0.metrics().dead_letters_by_class.get("max_deliveries"),
        Some(&1)
    );
    stop_reaper(r).await;
}

/// Which reaper recovered `id` (the `by` of its one recovery event). The
/// event follows the re-offer's record write, so a fast worker may have
/// finished the job before it is published: it is waited for.
async fn recovered_by(env: &Fleet, id: &str) -> String {
    let recovery = |e: &leasehold_proto::JobEvent| {
        e.r#type == "progress" && e.data_map().get("recovered") == Some(&json!(true))
    };
    env.wait_event_where(id, "recovered", recovery, Duration::from_secs(10))
        .await;
    let by: Vec<String> = env
        .events_of(id)
        .await
        .iter()
        .filter(|e| recovery(e))
        .map(|e| e.data_map()["by"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(by.len(), 1, "{id}: one recovery, by {by:?}");
    by[0].clone()
}

/// Reapers split the sweep by a stable hash of the job id: with two, each
/// job stranded by a gone worker is recovered once, by the reaper owning
/// its shard. Killed (-9), a reaper stops answering the roll call and the
/// other owns every shard within seconds, recovering the next ones alone.
#[tokio::test]
async fn reapers_split_the_sweep_by_shard_and_a_killed_reapers_shards_move() {
    use leasehold_testkit::doors::reaper::{Shards, SHARDS};
    let env = Fleet::start().await;
    let mut a = reaper_proc(&env, "reaper-a", env.url());
    let mut o = env.reaper_opts();
    o.reaper_id = Some("reaper-b".into());
    let b = env.reaper_with(o).await;
    let mut mb = b.0.metrics_watch();
    tokio::time::timeout(Duration::from_secs(20), mb.wait_for(|m| m.reapers == 2))
        .await
        .expect("reaper-b hears reaper-a")
        .unwrap();
    // And reaper-a hears reaper-b: until both rolls agree, reaper-a still
    // sweeps every shard (a job is acted on once either way: the writes
    // are conditioned), and which of the two recovered a job is not yet
    // the shards' answer.
    leasehold_testkit::wait_log(&a, "reapers=2", Duration::from_secs(20)).await;
    let share = Shards::new("reaper-b", ["reaper-a".to_string()]);
    assert!(share.owned() > 0 && share.owned() < SHARDS);
    let ids = reoffered_echoes(&env, "split", 24).await;
    complete_with_a_worker(&env, &ids).await;
    let by_b = recovered_by_shard(&env, &ids, &share).await;
    assert!(
        by_b > 0 && by_b < ids.len(),
        "both reapers had jobs: {by_b} of {}",
        ids.len()
    );

    a.kill9();
    tokio::time::timeout(
        Duration::from_secs(10),
        mb.wait_for(|m| m.reapers == 1 && m.shards == SHARDS),
    )
    .await
    .expect("reaper-b owns every shard once reaper-a is gone")
    .unwrap();
    let alone = reoffered_echoes(&env, "alone", 12).await;
    complete_with_a_worker(&env, &alone).await;
    for id in &alone {
        assert_eq!(recovered_by(&env, id).await, "reaper reaper-b", "{id}");
    }
    stop_reaper(b).await;
}

/// Seeds `n` echo jobs `<prefix>-<i>` whose running owner is gone (ticket
/// 1: an earlier ticket than any re-offer's, as in life; a made-up later
/// sequence made a worker that read the record before the reaper's write
/// drop the re-offer's ticket as superseded, and the job waited for the
/// stranded check). Their ids.
async fn stranded_echoes(env: &Fleet, prefix: &str, n: usize) -> Vec<String> {
    let ids: Vec<String> = (0..n).map(|i| format!("{prefix}-{i}")).collect();
    for (i, id) in ids.iter().enumerate() {
        env.seed_record(&abandoned(id, "echo", json!({"i": i}), 1, 0))
            .await;
    }
    ids
}

/// [`stranded_echoes`], each then waited for until a reaper re-offered it
/// (queued), with no worker running: a worker that took a re-offer's
/// ticket before the reaper wrote the record would find the job still
/// running by its gone owner and reclaim it itself; the reaper's write
/// then loses, and no recovery event says which reaper found the job.
async fn reoffered_echoes(env: &Fleet, prefix: &str, n: usize) -> Vec<String> {
    let ids = stranded_echoes(env, prefix, n).await;
    for id in &ids {
        env.wait_status(id, "queued", Duration::from_secs(20)).await;
    }
    ids
}

/// Runs a worker until every one of `ids` completed, then stops it.
async fn complete_with_a_worker(env: &Fleet, ids: &[String]) {
    let (w, stop) = env.worker().await;
    for id in ids {
        env.wait_status(id, "completed", Duration::from_secs(20))
            .await;
    }
    stop.cancel();
    w.wait().await.unwrap();
}

/// A `leasehold-reaper` process `id` at `url`, sweeping every 300 ms.
fn reaper_proc(env: &Fleet, id: &str, url: String) -> Proc {
    Proc::spawn(
        "leasehold-reaper",
        &[],
        &[
            ("NATS_URL", url),
            ("LH_PREFIX", env.prefix.clone()),
            ("LH_REAPER_ID", id.into()),
            ("LH_INTERVAL", "300ms".into()),
            ("RUST_LOG", "info".into()),
        ],
    )
}

/// Asserts the reaper owning each job's shard (`share` is reaper-b's;
/// reaper-a has the rest) recovered it; how many were reaper-b's.
async fn recovered_by_shard(
    env: &Fleet,
    ids: &[String],
    share: &leasehold_testkit::doors::reaper::Shards,
) -> usize {
    let mut by_b = 0;
    for id in ids {
        let want = if share.mine(id) {
            "reaper reaper-b"
        } else {
            "reaper reaper-a"
        };
        assert_eq!(recovered_by(env, id).await, want, "{id}");
        by_b += usize::from(share.mine(id));
    }
    by_b
}

/// The ids that answer one roll call within a second, sorted.
async fn roll_call(env: &Fleet) -> Vec<String> {
    let inbox = env.conn.client.new_inbox();
    let mut answers = env.conn.client.subscribe(inbox.clone()).await.unwrap();
    env.conn
        .client
        .publish_with_reply(
            env.conn.layout.reaper_roll_subject(),
            inbox,
            bytes::Bytes::new(),
        )
        .await
        .unwrap();
    let mut ids = Vec::new();
    let end = tokio::time::Instant::now() + Duration::from_secs(1);
    while let Ok(Some(m)) = tokio::time::timeout_at(end, answers.next()).await {
        ids.push(String::from_utf8_lossy(&m.payload).into_owned());
    }
    ids.sort();
    ids
}

/// A reaper that cannot read its view of the index yet (at a million
/// active jobs that takes seconds; here the server never answers its
/// watch, dropped by the fault proxy) answers no roll call, so it takes
/// no shard it cannot sweep: the reaper that can sweeps them all, and
/// every job of a gone worker is recovered, by it. Once the view is read,
/// the new reaper answers and takes its share.
#[tokio::test]
async fn a_reaper_still_reading_its_view_takes_no_shards() {
    use leasehold_testkit::doors::reaper::{Shards, SHARDS};
    let env = Fleet::start().await;
    let a = reaper_proc(&env, "reaper-a", env.url());
    leasehold_testkit::wait_log(&a, "reaper starting", Duration::from_secs(20)).await;
    let proxy = leasehold_harness::FaultProxy::start(&env.url()).await;
    let watch = format!(
        "$JS.API.CONSUMER.CREATE.KV_{}",
        env.conn.layout.active_bucket()
    );
    proxy.drop_matching(&watch);
    proxy.drop_matching(&format!("{watch}.>"));
    let b = reaper_proc(&env, "reaper-b", proxy.url());
    // It runs and hears reaper-a's answers ...
    leasehold_testkit::wait_log(&b, "reapers=2", Duration::from_secs(20)).await;
    assert!(
        proxy.published(&format!("{watch}.>")) + proxy.published(&watch) >= 1,
        "reaper-b asked for its watch"
    );
    // ... but answers no roll call itself.
    assert_eq!(roll_call(&env).await, ["reaper-a"]);
    // So reaper-a sweeps every shard.
    let blind = reoffered_echoes(&env, "blind", 16).await;
    complete_with_a_worker(&env, &blind).await;
    for id in &blind {
        assert_eq!(recovered_by(&env, id).await, "reaper reaper-a", "{id}");
    }
    assert!(
        !a.output().contains("reapers=2"),
        "reaper-a counted a reaper that could not sweep:\n{}",
        a.output()
    );
    assert_eq!(roll_call(&env).await, ["reaper-a"]);
    // Its view read, reaper-b answers and takes its share.
    proxy.clear();
    leasehold_testkit::wait_log(&b, "answering the roll call", Duration::from_secs(30)).await;
    leasehold_testkit::wait_log(&a, "reapers=2", Duration::from_secs(20)).await;
    let share = Shards::new("reaper-b", ["reaper-a".to_string()]);
    assert!(share.owned() > 0 && share.owned() < SHARDS);
    let more = reoffered_echoes(&env, "seen", 24).await;
    complete_with_a_worker(&env, &more).await;
    let by_b = recovered_by_shard(&env, &more, &share).await;
    assert!(by_b > 0, "reaper-b recovered none of {}", more.len());
    drop((a, b));
}

#[tokio::test]
async fn two_reapers_act_on_each_job_exactly_once() {
    let env = Fleet::start().await;
    // Stranded jobs (tickets lost) beside the poison ones: both replicas
    // see them, one ticket each must come out.
    let stranded: Vec<String> = (0..4).map(|i| format!("lost-{i}")).collect();
    for (i, id) in stranded.iter().enumerate() {
        env.seed_record(&abandoned(id, "echo", json!({"i": i}), 900 + i as u64, 0))
            .await;
    }
    let ids: Vec<String> = (0..8).map(|i| format!("poison-{i}")).collect();
    for id in &ids {
        let p = env.ticket("sleep", json!({"input": {"ms": 1}}), id).await;
        env.seed_record(&abandoned(id, "sleep", json!({"ms": 1}), p, 3))
            .await;
    }
    let a = env.reaper().await;
    let b = env.reaper().await;
    for id in &ids {
        let rec = env.wait_status(id, "dead", Duration::from_secs(10)).await;
        assert_eq!(rec.error.as_ref().unwrap().class, "poison");
    }
    // Let both replicas sweep a few more times over the dead records.
    let (mut wa, mut wb) = (a.0.metrics_watch(), b.0.metrics_watch());
    for _ in 0..3 {
        wa.changed().await.unwrap();
        wb.changed().await.unwrap();
    }
    for id in &ids {
        assert_eq!(
            env.letters_of(id).await.len(),
            1,
            "{id}: exactly one dead letter"
        );
        assert_eq!(
            dead_events_of(&env, id).await,
            1,
            "{id}: exactly one dead event"
        );
        let rec = env.record(id).await.unwrap();
        assert!(
            env.work.get(rec.ticket_seq).await.unwrap().is_none(),
            "{id}: ticket deleted"
        );
        let deaths = env
            .jobs
            .history(id)
            .await
            .unwrap()
            .iter()
            .filter(|v| v.value.status == "dead")
            .count();
        assert_eq!(deaths, 1, "{id}: one dead write");
    }
    for id in &stranded {
        let rec = env
            .wait_for(id, Duration::from_secs(10), |r| {
                r.ticket_seq > 0 && r.ticket_seq < 900
            })
            .await;
        assert!(
            env.work.get(rec.ticket_seq).await.unwrap().is_some(),
            "{id}: new ticket in place"
        );
        let recovered = env
            .events_of(id)
            .await
            .iter()
            .filter(|e| e.r#type == "progress")
            .count();
        assert_eq!(recovered, 1, "{id}: one recovery event");
    }
    let mut work = env
        .conn
        .js
        .get_stream(env.conn.layout.work_stream())
        .await
        .unwrap();
    let tickets = work.info().await.unwrap().state.messages;
    assert_eq!(
        tickets,
        stranded.len() as u64,
        "one ticket per stranded job, none left for the dead ones"
    );
    let recoveries =
        a.0.stats.recoveries.load(Ordering::Relaxed) + b.0.stats.recoveries.load(Ordering::Relaxed);
    assert_eq!(
        recoveries,
        stranded.len() as u64,
        "each recovery counted once"
    );
    // Purge asks for confirmation; without a terminal it needs --yes.
    let (code, _, err) = cli(&env, &["dlq", "purge"]).await;
    assert_ne!(code, 0);
    assert!(err.contains("--yes"), "{err}");
    let (code, out, err) = cli(&env, &["dlq", "purge", "--yes"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains(&format!("\"purged\":{}", ids.len())), "{out}");
    let won = a.0.stats.poison.load(Ordering::Relaxed) + b.0.stats.poison.load(Ordering::Relaxed);
    assert_eq!(
        won,
        ids.len() as u64,
        "each death written by exactly one replica"
    );
    stop_reaper(a).await;
    stop_reaper(b).await;
}

/// Keeps `n` worker processes alive, restarting those that die, until cancelled.
fn supervise(
    env: &Fleet,
    n: usize,
    extra: Vec<(&'static str, String)>,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<usize> {
    let mut procs: Vec<Proc> = (0..n).map(|_| env.worker_proc(&[], &extra)).collect();
    let envv = env.proc_env();
    tokio::spawn(async move {
        let mut deaths = 0;
        while !stop.is_cancelled() {
            for p in procs.iter_mut() {
                // Reaps the dead one, so dropping it signals nobody.
                if p.wait_timeout(Duration::ZERO).is_some() {
                    deaths += 1;
                    let mut e = envv.clone();
                    e.extend(extra.iter().cloned());
                    *p = Proc::spawn("leasehold-worker", &[], &e);
                }
            }
            tokio::select! { _ = tokio::time::sleep(Duration::from_millis(50)) => {}, _ = stop.cancelled() => {} }
        }
        for p in procs.iter_mut() {
            p.kill9();
        }
        deaths
    })
}

#[tokio::test]
async fn crash_job_becomes_poison_while_the_fleet_finishes_the_rest() {
    let env = Fleet::start().await;
    let stop = CancellationToken::new();
    // Several slots per worker: a crash takes down every job of its process.
    // A worker runs one suspect (two stale reclaims or more) at a time, so
    // once the crash job is a suspect it never meets another suspect again:
    // its bystanders complete, and only the crash job keeps losing workers.
    let extra = vec![
        ("LH_SESSION_TIMEOUT", "1s".to_string()),
        ("LH_CONCURRENCY", "4".to_string()),
    ];
    let fleet = supervise(&env, 3, extra, stop.clone());
    let r = env.reaper().await;
    env.submit("crash", json!({"input": {}}), "crasher").await;
    let others: Vec<String> = (0..12).map(|i| format!("bystander-{i}")).collect();
    for (i, id) in others.iter().enumerate() {
        if i % 2 == 0 {
            env.submit("echo", json!({"input": {"i": i}}), id).await;
        } else {
            env.submit("sleep", json!({"input": {"ms": 1500}}), id)
                .await;
        }
    }
    let dead = env
        .wait_status("crasher", "dead", Duration::from_secs(25))
        .await;
    assert_eq!(dead.error.as_ref().unwrap().class, "poison");
    assert_eq!(dead.stale_reclaims, 3);
    for id in &others {
        let r = env
            .wait_status(id, "completed", Duration::from_secs(20))
            .await;
        // Its first two crashes may take a bystander along twice; after that
        // the crash job is a suspect and no suspect shares its worker.
        assert!(
            r.stale_reclaims <= 3,
            "{id} was never past the poison limit"
        );
    }
    let mut m = r.0.metrics_watch();
    m.changed().await.unwrap();
    m.changed().await.unwrap();
    assert_eq!(env.letters_of("crasher").await.len(), 1, "one dead letter");
    assert_eq!(dead_events_of(&env, "crasher").await, 1);
    stop.cancel();
    let deaths = fleet.await.unwrap();
    assert!(
        deaths >= 4,
        "the crash job killed a worker at each of its 4 claims (saw {deaths})"
    );
    stop_reaper(r).await;
}

#[tokio::test]
async fn dlq_replay_completes_the_job_with_a_fresh_budget() {
    let env = Fleet::start().await;
    let p = env
        .ticket("echo", json!({"input": {"v": 7}}), "replayed")
        .await;
    env.seed_record(&abandoned("replayed", "echo", json!({"v": 7}), p, 3))
        .await;
    let r = env.reaper().await;
    env.wait_status("replayed", "dead", Duration::from_secs(10))
        .await;
    stop_reaper(r).await;
    let letters = env.letters_of("replayed").await;
    assert_eq!(letters.len(), 1);
    let seq = letters[0].seq.to_string();

    let (code, out, err) = cli(&env, &["dlq", "list", "--json"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("\"replayed\"") && out.contains("poison"),
        "{out}"
    );
    let (code, out, err) = cli(&env, &["dlq", "show", &seq]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("\"stale_reclaims\": 3"), "{out}");

    let (w, stop_w) = env.worker().await;
    let (code, _, err) = cli(&env, &["dlq", "replay", &seq]).await;
    assert_eq!(code, 0, "{err}");
    let done = env
        .wait_status("replayed", "completed", Duration::from_secs(10))
        .await;
    assert_eq!(done.result.unwrap().output, json!({"v": 7}).to_string());
    // A fresh attempt budget: the replayed claim is not a stale reclaim.
    assert_eq!(done.stale_reclaims, 0);
    let history = env.jobs.history("replayed").await.unwrap();
    assert!(
        history.iter().any(|v| v.value.status == "dead"),
        "history kept"
    );
    // Replaying a letter whose job is running again is refused; a missing letter says so.
    let (code, _, err) = cli(&env, &["dlq", "replay", "999"]).await;
    assert_ne!(code, 0);
    assert!(err.contains("dlq list"), "{err}");
    stop_w.cancel();
    w.wait().await.unwrap();
}

#[tokio::test]
async fn review_resume_and_fail_parked_jobs() {
    let env = Fleet::start().await;
    for id in ["parked-a", "parked-b"] {
        let mut r = machine::new_record(id, "echo", spec(json!({"id": id})), 0, SystemTime::now());
        r.spec.as_mut().unwrap().id = Some(id.into());
        r.status = "parked".into();
        r.epoch = 1;
        r.parked_reason = Some("uncertain_effect".into());
        r.error = Some(leasehold_testkit::record::JobError {
            class: "uncertain_effect".into(),
            message: "publish may have happened".into(),
            at: rfc3339(SystemTime::now()),
        });
        env.seed_record(&r).await;
    }
    let (code, out, err) = cli(&env, &["review", "list"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("parked-a")
            && out.contains("uncertain_effect")
            && out.contains("publish may have happened"),
        "{out}"
    );

    let (w, stop_w) = env.worker().await;
    let (code, _, err) = cli(&env, &["review", "resume", "parked-a"]).await;
    assert_eq!(code, 0, "{err}");
    let done = env
        .wait_status("parked-a", "completed", Duration::from_secs(10))
        .await;
    assert_eq!(
        done.result.unwrap().output,
        json!({"id": "parked-a"}).to_string()
    );

    let (code, _, err) = cli(
        &env,
        &[
            "review",
            "fail",
            "parked-b",
            "--reason",
            "operator declined",
        ],
    )
    .await;
    assert_eq!(code, 0, "{err}");
    let failed = env.record("parked-b").await.unwrap();
    assert_eq!(failed.status, "failed");
    assert_eq!(failed.error.unwrap().message, "operator declined");
    // Only parked jobs can be resumed or failed; the error says what to do.
    let (code, _, err) = cli(&env, &["review", "resume", "parked-b"]).await;
    assert_ne!(code, 0);
    assert!(err.contains("parked"), "{err}");
    stop_w.cancel();
    w.wait().await.unwrap();
}

#[tokio::test]
async fn dlq_replay_of_a_rejected_submission_resends_its_raw_bytes() {
    let env = Fleet::start().await;
    // A worker with a tiny size limit rejects the submission...
    let mut o = env.opts();
    o.max_submission_bytes = 16;
    let (strict, stop_strict) = env.worker_with(o).await;
    let raw = json!({"input": {"text": "more than sixteen bytes"}}).to_string();
    env.work
        .submit("echo", raw.clone().into(), Some("too-big"), None)
        .await
        .unwrap();
    let rejected = env
        .wait_status("too-big", "rejected", Duration::from_secs(10))
        .await;
    assert!(rejected.error.unwrap().message.contains("16"));
    stop_strict.cancel();
    strict.wait().await.unwrap();
    let letters = env.letters_of("too-big").await;
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0].class, "rejected");
    assert_eq!(
        &letters[0].payload[..],
        raw.as_bytes(),
        "raw bytes kept byte for byte"
    );

    // ...and after the limit is raised, the replay runs it under the same id.
    let (w, stop_w) = env.worker().await;
    let seq = letters[0].seq.to_string();
    let (code, out, err) = cli(&env, &["dlq", "replay", &seq]).await;
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("rejected submission") && err.contains("16"),
        "the reason is shown first: {err}"
    );
    assert!(out.contains("too-big"), "{out}");
    let done = env
        .wait_status("too-big", "completed", Duration::from_secs(10))
        .await;
    assert_eq!(
        done.result.unwrap().output,
        json!({"text": "more than sixteen bytes"}).to_string()
    );
    assert!(
        env.letters_of("too-big").await.is_empty(),
        "the replayed letter is deleted"
    );
    stop_w.cancel();
    w.wait().await.unwrap();
}

#[tokio::test]
async fn reaper_binary_serves_metrics_and_stops_on_sigterm() {
    let env = Fleet::start().await;
    let mut q = machine::new_record("waiting", "echo", spec(json!({})), 0, SystemTime::now());
    q.status = "parked".into();
    env.seed_record(&q).await;
    let mut p = Proc::spawn(
        "leasehold-reaper",
        &["--reaper-id", "reaper-bin"],
        &[
            ("NATS_URL", env.url()),
            ("LH_PREFIX", env.prefix.clone()),
            ("LH_INTERVAL", "200ms".into()),
        ],
    );
    let subject = env.conn.layout.reaper_metrics_subject();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let metrics = loop {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no metrics reply:\n{}",
            p.output()
        );
        let reply = tokio::time::timeout(
            Duration::from_millis(500),
            env.conn.client.request(subject.clone(), "".into()),
        )
        .await;
        if let Ok(Ok(m)) = reply {
            let m: leasehold_testkit::doors::reaper::Metrics =
                serde_json::from_slice(&m.payload).unwrap();
            if m.sweeps > 0 {
                break m;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        (metrics.reaper_id.as_str(), metrics.parked, metrics.jobs),
        ("reaper-bin", 1, 1)
    );
    p.term();
    let status = p
        .wait_timeout(Duration::from_secs(10))
        .expect("the reaper exits on SIGTERM");
    assert!(status.success(), "{}", p.output());
}

#[tokio::test]
async fn dlq_list_pages_and_filters_on_the_server_without_payloads() {
    let env = Fleet::start().await;
    let dlq = Dlq::new(&env.conn);
    for i in 0..5 {
        let kind = if i % 2 == 0 { "echo" } else { "sleep" };
        dlq.reject(
            kind,
            Some(&format!("bad-{i}")),
            "not_json",
            "input: not JSON",
            bytes::Bytes::from(vec![b'x'; 100_000]),
            None,
            &format!("rej-{i}"),
        )
        .await
        .unwrap();
    }
    let (code, out, err) = cli(&env, &["dlq", "list", "--limit", "2", "--json"]).await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.lines().count(), 2);
    let last: serde_json::Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    let after = last["seq"].as_u64().unwrap().to_string();
    assert!(err.contains(&format!("--after {after}")), "{err}");
    let (_, out, err) = cli(&env, &["dlq", "list", "--after", &after, "--json"]).await;
    assert_eq!(out.lines().count(), 3, "{err}");
    let (_, out, _) = cli(&env, &["dlq", "list", "--kind", "echo", "--json"]).await;
    assert_eq!(out.lines().count(), 3);
    assert!(out.lines().all(|l| l.contains("\"echo\"")));
    // Headers only: listing never pulled the 100 kB payloads.
    let (letters, more) = dlq.page(None, Some("rejected"), 0, 10).await.unwrap();
    assert_eq!((letters.len(), more), (5, false));
    assert!(letters.iter().all(|l| l.payload.is_empty()));
}

// Issue 18: replaying a letter whose bytes are still refused used to send
// them anyway and delete the letter; the worker rejected them again and the
// new letter, carrying the same Nats-Msg-Id, was dropped by the DLQ's
// dedupe: the raw submission was gone.
#[tokio::test]
async fn dlq_replay_never_loses_a_letter_whose_bytes_are_still_refused() {
    let env = Fleet::start().await;
    let (w, stop_w) = env.worker().await;
    env.work
        .submit("echo", "{\"input\":[1,2".into(), Some("bad-1"), None)
        .await
        .unwrap();
    env.wait_status("bad-1", "rejected", Duration::from_secs(10))
        .await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let letters = loop {
        let l = env.letters_of("bad-1").await;
        if !l.is_empty() {
            break l;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no letter for bad-1: {:?}",
            Dlq::new(&env.conn).list().await.unwrap()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(letters.len(), 1);
    let seq = letters[0].seq.to_string();
    // Refused without sending anything.
    let (code, _, err) = cli(&env, &["dlq", "replay", &seq]).await;
    assert_ne!(code, 0, "{err}");
    assert!(
        err.contains("--spec") && err.contains("--force") && err.contains("kept"),
        "{err}"
    );
    assert_eq!(env.letters_of("bad-1").await.len(), 1);
    // Forced: sent, rejected again, and the letter is still there.
    let (code, out, err) = cli(&env, &["dlq", "replay", &seq, "--force", "--wait", "2s"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("\"letter_deleted\":false"), "{out}");
    let kept = env.letters_of("bad-1").await;
    assert!(
        kept.iter().any(|l| l.seq == letters[0].seq),
        "the original letter stays: {kept:?}"
    );
    // A corrected submission runs under the same id; then the letter goes.
    let fixed = std::env::temp_dir().join(format!("lh-fixed-{}.json", std::process::id()));
    std::fs::write(&fixed, r#"{"input":{"list":[1,2]}}"#).unwrap();
    let (code, out, err) = cli(
        &env,
        &["dlq", "replay", &seq, "--spec", fixed.to_str().unwrap()],
    )
    .await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("\"letter_deleted\":true"), "{out}\n{err}");
    let done = env
        .wait_status("bad-1", "completed", Duration::from_secs(10))
        .await;
    assert_eq!(done.result.unwrap().output, r#"{"list":[1,2]}"#);
    assert!(!env
        .letters_of("bad-1")
        .await
        .iter()
        .any(|l| l.seq == letters[0].seq));
    stop_w.cancel();
    w.wait().await.unwrap();
}

// A replayed submission that no worker takes keeps its letter.
#[tokio::test]
async fn dlq_replay_keeps_the_letter_until_a_worker_accepts_the_job() {
    let env = Fleet::start().await;
    let mut o = env.opts();
    o.max_submission_bytes = 16;
    let (strict, stop_strict) = env.worker_with(o).await;
    env.ticket(
        "echo",
        json!({"input": {"text": "more than sixteen bytes"}}),
        "no-taker",
    )
    .await;
    env.wait_status("no-taker", "rejected", Duration::from_secs(10))
        .await;
    stop_strict.cancel();
    strict.wait().await.unwrap();
    let seq = env.letters_of("no-taker").await[0].seq.to_string();
    let (code, out, err) = cli(&env, &["dlq", "replay", &seq, "--wait", "1s"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("kept"), "{err}");
    assert!(out.contains("\"letter_deleted\":false"), "{out}");
    assert_eq!(env.letters_of("no-taker").await.len(), 1);
    // The job is queued and indexed meanwhile; a worker runs it, and a
    // second replay (safe: the resubmission is recognised) lets it go.
    let (w, stop_w) = env.worker().await;
    env.wait_status("no-taker", "completed", Duration::from_secs(10))
        .await;
    let (code, out, err) = cli(&env, &["dlq", "replay", &seq]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("\"letter_deleted\":true"), "{out}\n{err}");
    stop_w.cancel();
    w.wait().await.unwrap();
}

// Ticket first: a dead job's replay into a full work queue changes nothing
// (before, the record said `queued` with no ticket, for ever) and can be
// run again once there is room.
#[tokio::test]
async fn dlq_replay_into_a_full_queue_leaves_the_dead_job_and_its_letter() {
    let env = Fleet::with(SetupOptions {
        work_max_msgs: 1,
        ..SetupOptions::default()
    })
    .await;
    let seq = env
        .ticket("echo", json!({"input": {"v": 1}}), "full-replay")
        .await;
    env.seed_record(&abandoned("full-replay", "echo", json!({"v": 1}), seq, 3))
        .await;
    let r = env.reaper().await;
    env.wait_status("full-replay", "dead", Duration::from_secs(10))
        .await;
    stop_reaper(r).await;
    let seq = env.letters_of("full-replay").await[0].seq.to_string();
    // The queue's one place is taken.
    env.work
        .submit("echo", "{\"input\":{}}".into(), Some("occupant"), None)
        .await
        .unwrap();
    let (code, _, err) = cli(&env, &["dlq", "replay", &seq]).await;
    assert_ne!(code, 0, "{err}");
    assert!(err.contains("kept") && err.contains("again"), "{err}");
    assert_eq!(env.record("full-replay").await.unwrap().status, "dead");
    assert_eq!(env.letters_of("full-replay").await.len(), 1);
    // Room again: the same command works.
    let (w, stop_w) = env.worker().await;
    env.wait_status("occupant", "completed", Duration::from_secs(10))
        .await;
    let (code, out, err) = cli(&env, &["dlq", "replay", &seq]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("\"letter_deleted\":true"), "{out}");
    env.wait_status("full-replay", "completed", Duration::from_secs(10))
        .await;
    stop_w.cancel();
    w.wait().await.unwrap();
}

// Issue 18: `review resume` wrote `queued` before publishing the ticket;
// into a full queue the job was queued for ever with no ticket and the
// command refused to run again. Ticket first: nothing changes, and the
// same command works once there is room.
#[tokio::test]
async fn review_resume_into_a_full_queue_leaves_the_job_parked_and_can_be_run_again() {
    let env = Fleet::with(SetupOptions {
        work_max_msgs: 1,
        ..SetupOptions::default()
    })
    .await;
    let mut r = machine::new_record("held", "echo", spec(json!({"v": 2})), 0, SystemTime::now());
    r.status = "parked".into();
    r.epoch = 1;
    r.parked_reason = Some("uncertain_effect".into());
    env.seed_record(&r).await;
    env.work
        .submit("echo", "{\"input\":{}}".into(), Some("occupant"), None)
        .await
        .unwrap();
    let (code, _, err) = cli(&env, &["review", "resume", "held"]).await;
    assert_ne!(code, 0, "{err}");
    assert!(
        err.contains("nothing changed") && err.contains("again"),
        "{err}"
    );
    let now = env.record("held").await.unwrap();
    assert_eq!((now.status.as_str(), now.ticket_seq), ("parked", 0));
    let (w, stop_w) = env.worker().await;
    env.wait_status("occupant", "completed", Duration::from_secs(10))
        .await;
    let (code, _, err) = cli(&env, &["review", "resume", "held"]).await;
    assert_eq!(code, 0, "{err}");
    let done = env
        .wait_status("held", "completed", Duration::from_secs(10))
        .await;
    assert_eq!(done.result.unwrap().output, json!({"v": 2}).to_string());
    stop_w.cancel();
    w.wait().await.unwrap();
}

// Issue 30, G5: a corrected replay of a job whose input was over 16 KiB
// (kept beside its record, create-if-absent under `<id>.input`) used to
// run the original input: the requeue kept the record's `input_beside`
// and cleared the new input, and a large new input lost to the old one
// already under that key.
#[tokio::test]
async fn dlq_replay_with_a_corrected_spec_runs_the_corrected_input_of_a_large_input_job() {
    let env = Fleet::start().await;
    let (w, stop_w) = env.worker().await;
    let pad = "p".repeat(20 << 10);
    let recovery =
        leasehold_testkit::doors::history::Recovery::open(&env.conn, "test-reaper".into(), 2)
            .await
            .unwrap();
    // Both shapes of correction: a small input (kept in the record) and a
    // large one (kept beside it, like the original).
    let cases = [
        ("big-1", json!({"ms": 1500, "pad": "x"})),
        ("big-2", json!({"ms": 1200, "pad": pad.clone()})),
    ];
    for (id, fixed) in &cases {
        // Delayed, so it waits as a recorded queued job with its input
        // beside its record; then dead-lettered as poison, as the reaper
        // does.
        env.submit(
            "sleep",
            json!({"input": {"ms": 10, "pad": pad}, "delay": "1h"}),
            id,
        )
        .await;
        let queued = env
            .wait_for(id, Duration::from_secs(10), |r| r.status == "queued")
            .await;
        assert!(queued.input_beside, "{queued:?}");
        recovery
            .kill(id, "poison", "crashed its workers", |_| true)
            .await
            .unwrap();
        let letter = env.letters_of(id).await;
        assert_eq!(letter.len(), 1, "{letter:?}");
        let file = std::env::temp_dir().join(format!("lh-g5-{id}-{}.json", std::process::id()));
        std::fs::write(&file, json!({ "input": fixed }).to_string()).unwrap();
        let (code, out, err) = cli(
            &env,
            &[
                "dlq",
                "replay",
                &letter[0].seq.to_string(),
                "--spec",
                file.to_str().unwrap(),
            ],
        )
        .await;
        assert_eq!(code, 0, "{out}\n{err}");
        let done = env
            .wait_status(id, "completed", Duration::from_secs(20))
            .await;
        let want = fixed["ms"].as_u64().unwrap();
        assert_eq!(
            done.result.unwrap().output,
            json!({ "slept_ms": want }).to_string(),
            "{id} ran the input it was corrected to"
        );
        // Read back, the record holds the corrected input, whole.
        let rec = env.record(id).await.unwrap();
        let input: serde_json::Value = serde_json::from_str(&rec.spec.unwrap().input).unwrap();
        assert_eq!(&input, fixed);
    }
    stop_w.cancel();
    w.wait().await.unwrap();
}
