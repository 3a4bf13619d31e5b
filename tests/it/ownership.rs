//! The ownership protocol: claims, sessions, fencing, reclaims, handoff.

use std::time::{Duration, SystemTime};

use leasehold_testkit::doors::owner::FenceError;
use leasehold_testkit::doors::owner::{machine, ClaimDecision, Claimant, Owner, OwnerLiveness};
use leasehold_testkit::doors::owner::{Gate, JobsError};
use leasehold_testkit::record::JobSpec;
use serde_json::json;

use leasehold_testkit::{wait_log, Fleet};

/// A claimant that takes the recorded owner as `owner`.
fn claimant(worker: &str, owner: OwnerLiveness) -> Claimant<'_> {
    Claimant {
        worker_id: worker,
        session: "test-session",
        claim_token: uuid::Uuid::new_v4().to_string(),
        attempt_timeout: Duration::from_secs(60),
        skew: Duration::from_secs(2),
        now: SystemTime::now(),
        ticket_seq: 0,
        max_stale_reclaims: 3,
        owner,
        deliveries: 1,
        signalled: false,
    }
}

/// Claims `id` as `worker` through the real KV; `None` when the decision is not a claim.
async fn try_claim(
    env: &Fleet,
    id: &str,
    worker: &str,
    owner: OwnerLiveness,
) -> Result<Option<Owner>, JobsError> {
    let c = claimant(worker, owner);
    let v = env
        .jobs
        .transition(id, |r| match machine::decide_claim(r, &c) {
            ClaimDecision::Claim { record, .. } => Ok(Some(*record)),
            _ => Ok(None),
        })
        .await?;
    Ok(
        (v.value.claim_token.as_deref() == Some(c.claim_token.as_str()))
            .then(|| Owner::of(&v.value).unwrap()),
    )
}

#[tokio::test]
async fn two_workers_race_to_claim_one_job_exactly_one_wins() {
    let env = Fleet::start().await;
    for round in 0..20 {
        let id = format!("race-{round}");
        env.jobs
            .create(&machine::new_record(
                &id,
                "echo",
                JobSpec::default(),
                1,
                SystemTime::now(),
            ))
            .await
            .unwrap();
        let mut tasks = Vec::new();
        for w in 0..4 {
            let jobs = env.jobs.clone();
            let id = id.clone();
            tasks.push(tokio::spawn(async move {
                let c = claimant(["a", "b", "c", "d"][w], OwnerLiveness::Live);
                let token = c.claim_token.clone();
                let v = jobs
                    .transition(&id, |r| match machine::decide_claim(r, &c) {
                        ClaimDecision::Claim { record, .. } => Ok(Some(*record)),
                        _ => Ok(None),
                    })
                    .await
                    .unwrap();
                v.value.claim_token == Some(token)
            }));
        }
        let mut winners = 0;
        for t in tasks {
            winners += usize::from(t.await.unwrap());
        }
        assert_eq!(winners, 1, "round {round}: exactly one claim must win");
        let rec = env.record(&id).await.unwrap();
        assert_eq!((rec.status.as_str(), rec.epoch), ("running", 1));
    }
}

#[tokio::test]
async fn a_fleet_runs_each_job_once() {
    let env = Fleet::start().await;
    let mut workers = Vec::new();
    for _ in 0..3 {
        workers.push(env.worker().await);
    }
    let ids: Vec<String> = (0..40).map(|i| format!("fleet-{i}")).collect();
    for id in &ids {
        env.submit("echo", json!({"input": {"n": id}}), id).await;
    }
    for id in &ids {
        let r = env
            .wait_status(id, "completed", Duration::from_secs(20))
            .await;
        assert_eq!(r.epoch, 1, "{id} was claimed more than once");
        let history = env.jobs.history(id).await.unwrap();
        let completions = history
            .iter()
            .filter(|v| v.value.status == "completed")
            .count();
        assert_eq!(
            completions, 1,
            "{id}: exactly one completion in the record's history"
        );
    }
    let claimed: u64 = workers
        .iter()
        .map(|(h, _)| h.metrics.total(leasehold::Count::Claimed))
        .sum();
    assert_eq!(claimed, 40);
    for (h, stop) in workers {
        stop.cancel();
        h.wait().await.unwrap();
    }
}

#[tokio::test]
async fn same_worker_reclaiming_its_job_fences_its_older_task() {
    let env = Fleet::start().await;
    env.jobs
        .create(&machine::new_record(
            "self",
            "echo",
            JobSpec::default(),
            1,
            SystemTime::now(),
        ))
        .await
        .unwrap();
    let old = try_claim(&env, "self", "w1", OwnerLiveness::Live)
        .await
        .unwrap()
        .expect("first claim");
    // While its owner's session lives, nobody takes the job.
    assert!(try_claim(&env, "self", "w2", OwnerLiveness::Live)
        .await
        .unwrap()
        .is_none());
    // The session ended (a restart of the same identity): the next claim
    // is a reclaim that fences the older task.
    let new = try_claim(&env, "self", "w1", OwnerLiveness::Dead)
        .await
        .unwrap()
        .expect("reclaim");
    assert_eq!(new.worker_id, old.worker_id);
    assert_eq!(new.epoch, old.epoch + 1);
    let old_gate = Gate::new(env.jobs.clone(), "self", old);
    let err = old_gate.touch().await.unwrap_err();
    assert!(err.is_ownership_lost(), "{err}");
    let err = old_gate
        .write(|r, o, now| machine::complete(r, o, now, Default::default()))
        .await
        .unwrap_err();
    assert!(err.is_ownership_lost(), "{err}");
    let new_gate = Gate::new(env.jobs.clone(), "self", new);
    new_gate
        .write(|r, o, now| machine::complete(r, o, now, Default::default()))
        .await
        .unwrap();
    let rec = env.record("self").await.unwrap();
    assert_eq!((rec.status.as_str(), rec.stale_reclaims), ("completed", 1));
}

#[tokio::test]
async fn stale_owners_events_are_refused_by_the_server() {
    let env = Fleet::start().await;
    let mut a = env
        .events
        .claim_marker("fenced", 1, "a", json!({}))
        .await
        .unwrap();
    a.publish("section", json!({"n": 1})).await.unwrap();
    let mut b = env
        .events
        .claim_marker("fenced", 2, "b", json!({}))
        .await
        .unwrap();
    match a.publish("section", json!({"n": 2})).await {
        Err(FenceError::Lost {
            ours: 1,
            newer_epoch: 2,
        }) => {}
        other => panic!("the stale owner's checkpoint must be refused, got {other:?}"),
    }
    // An owner paused between its KV claim and its marker cannot land the
    // marker after a newer owner's.
    match env.events.claim_marker("fenced", 1, "a", json!({})).await {
        Err(FenceError::Lost {
            ours: 1,
            newer_epoch: 2,
        }) => {}
        other => panic!(
            "a stale claim marker must be refused, got {:?}",
            other.map(|f| f.last_seq())
        ),
    }
    // An informational event from a non-owner does not fence the owner out.
    let info =
        leasehold_testkit::record::event("fenced", 1, "heartbeat_lost", Some("a"), json!({}));
    env.events.publish(&info, None).await.unwrap();
    b.publish("section", json!({"n": 2})).await.unwrap();
    let evs = env.events.read("fenced").await.unwrap();
    let sections: Vec<(u64, u64)> = evs
        .iter()
        .filter(|(_, e)| e.r#type == "section")
        .map(|(_, e)| (e.epoch, e.data_map()["n"].as_u64().unwrap()))
        .collect();
    assert_eq!(
        sections,
        vec![(1, 1), (2, 2)],
        "exactly the owners' checkpoints were stored"
    );
    let coherent = leasehold_testkit::doors::owner::coherent(&evs);
    assert!(coherent
        .iter()
        .all(|e| e.epoch == 2 || e.r#type != "heartbeat_lost"));
}

#[tokio::test]
async fn delayed_worker_paused_past_its_session_can_never_write() {
    let env = Fleet::start().await;
    let mut a = env.worker_proc(&["--worker-id", "worker-a"], &[]);
    env.submit("sleep", json!({"input": {"ms": 3000}}), "delayed")
        .await;
    env.wait_for("delayed", Duration::from_secs(15), |r| {
        r.status == "running" && r.worker_id.as_deref() == Some("worker-a")
    })
    .await;
    a.stop();
    let (b, stop_b) = env.worker().await;
    let reclaimed = env
        .wait_for("delayed", Duration::from_secs(15), |r| {
            r.status == "running" && r.worker_id.as_deref() == Some(b.worker_id.as_str())
        })
        .await;
    assert_eq!((reclaimed.epoch, reclaimed.stale_reclaims), (2, 1));
    let done = env
        .wait_status("delayed", "completed", Duration::from_secs(15))
        .await;
    a.cont();
    wait_log(&a, "ownership lost", Duration::from_secs(10)).await;
    // A kept running and tried to write; nothing it did landed.
    let after = env.record("delayed").await.unwrap();
    assert_eq!(after, done, "B's result stands");
    let history = env.jobs.history("delayed").await.unwrap();
    assert_eq!(
        history
            .iter()
            .filter(|v| v.value.status == "completed")
            .count(),
        1
    );
    let claim_b = history.iter().position(|v| v.value.epoch == 2).unwrap();
    assert!(
        history[claim_b..].iter().all(|v| v.value.epoch == 2),
        "no write of epoch 1 after B's claim"
    );
    let evs = env.events_of("delayed").await;
    let marker_b = evs
        .iter()
        .position(|e| e.r#type == "claimed" && e.epoch == 2)
        .unwrap();
    assert!(
        evs[marker_b..]
            .iter()
            .all(|e| e.epoch == 2 || e.r#type == "heartbeat_lost"),
        "{evs:#?}"
    );
    assert!(a.alive(), "a fenced worker keeps serving other work");
    stop_b.cancel();
    b.wait().await.unwrap();
}

#[tokio::test]
async fn killed_worker_is_reclaimed_after_its_session_ends() {
    let env = Fleet::start().await;
    let mut a = env.worker_proc(&[], &[]);
    env.submit("sleep", json!({"input": {"ms": 1500}}), "killed")
        .await;
    let first = env
        .wait_status("killed", "running", Duration::from_secs(15))
        .await;
    a.kill9();
    let (b, stop) = env.worker().await;
    let done = env
        .wait_status("killed", "completed", Duration::from_secs(20))
        .await;
    assert_eq!(done.worker_id.as_deref(), Some(b.worker_id.as_str()));
    assert_ne!(first.worker_id, done.worker_id);
    assert_eq!((done.epoch, done.stale_reclaims), (2, 1));
    stop.cancel();
    b.wait().await.unwrap();
}

#[tokio::test]
async fn sigterm_hands_running_jobs_back_at_once() {
    let env = Fleet::start().await;
    // A long session: only an explicit handoff lets B take over quickly.
    let mut a = env.worker_proc(&[], &[("LH_SESSION_TIMEOUT", "60s".into())]);
    env.submit("sleep", json!({"input": {"ms": 1500}}), "handoff")
        .await;
    env.wait_status("handoff", "running", Duration::from_secs(15))
        .await;
    let (b, stop) = env.worker().await;
    let t0 = tokio::time::Instant::now();
    a.term();
    let handed = env
        .wait_for("handoff", Duration::from_secs(10), |r| {
            r.status == "running" && r.worker_id.as_deref() == Some(b.worker_id.as_str())
        })
        .await;
    let took = t0.elapsed();
    assert!(
        took < Duration::from_secs(5),
        "handoff took {took:?}, far less than the 60 s session timeout"
    );
    assert_eq!(
        (handed.epoch, handed.stale_reclaims),
        (2, 0),
        "a handoff is not a stale reclaim"
    );
    let status = a
        .wait_timeout(Duration::from_secs(10))
        .expect("worker exits after SIGTERM");
    assert!(
        status.success(),
        "exit 0 after a graceful shutdown: {status:?}\n{}",
        a.output()
    );
    env.wait_status("handoff", "completed", Duration::from_secs(10))
        .await;
    stop.cancel();
    b.wait().await.unwrap();
}

#[tokio::test]
async fn stable_identity_restart_reclaims_at_once() {
    let env = Fleet::start().await;
    let extra = [("LH_SESSION_TIMEOUT", "60s".into())];
    let mut a = env.worker_proc(&["--worker-id", "pod-1"], &extra);
    env.submit("sleep", json!({"input": {"ms": 2000}}), "restart")
        .await;
    env.wait_for("restart", Duration::from_secs(15), |r| {
        r.status == "running" && r.worker_id.as_deref() == Some("pod-1")
    })
    .await;
    env.wait_indexed("restart", Duration::from_secs(10)).await;
    a.kill9();
    let t0 = tokio::time::Instant::now();
    let _a2 = env.worker_proc(&["--worker-id", "pod-1"], &extra);
    let r = env
        .wait_for("restart", Duration::from_secs(20), |r| r.epoch == 2)
        .await;
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "reclaimed well before the 60 s session timeout"
    );
    assert_eq!(
        (r.worker_id.as_deref(), r.stale_reclaims),
        (Some("pod-1"), 1)
    );
    let done = env
        .wait_status("restart", "completed", Duration::from_secs(15))
        .await;
    assert_eq!(done.epoch, 2);
}

#[tokio::test]
async fn a_paused_worker_holds_no_work_hostage() {
    let env = Fleet::start().await;
    let a = env.worker_proc(&[], &[]);
    // Let A's pull loops start, then freeze it with its pulls outstanding.
    wait_log(&a, "worker starting", Duration::from_secs(10)).await;
    a.stop();
    let (b, stop) = env.worker().await;
    let t0 = tokio::time::Instant::now();
    for i in 0..8 {
        env.submit("echo", json!({"input": {}}), &format!("hostage-{i}"))
            .await;
    }
    for i in 0..8 {
        env.wait_status(
            &format!("hostage-{i}"),
            "completed",
            Duration::from_secs(10),
        )
        .await;
    }
    // A delivery swallowed by the frozen worker waits at most one ack wait
    // (1 s) plus one pull expiry (250 ms) before B gets it; the bound leaves
    // room for a loaded machine and is still far below a session timeout.
    assert!(
        t0.elapsed() < Duration::from_secs(6),
        "took {:?}",
        t0.elapsed()
    );
    a.cont();
    stop.cancel();
    b.wait().await.unwrap();
}

#[tokio::test]
async fn a_worker_never_runs_more_jobs_than_its_slots() {
    let env = Fleet::start().await;
    let mut o = env.opts();
    o.concurrency = 2;
    o.kinds = vec!["sleep".into()];
    let (w, stop) = env.worker_with(o).await;
    let mut watch = env.jobs.watch_all().await.unwrap();
    for i in 0..8 {
        env.submit("sleep", json!({"input": {"ms": 300}}), &format!("slot-{i}"))
            .await;
    }
    // Follow every record change: the set of jobs running on this worker
    // must never exceed its two slots.
    let mut running = std::collections::HashSet::new();
    let mut done = 0;
    let mut peak = 0;
    while done < 8 {
        let e = tokio::time::timeout(
            Duration::from_secs(20),
            futures::StreamExt::next(&mut watch),
        )
        .await
        .unwrap()
        .unwrap()
        .unwrap();
        let r = leasehold_testkit::record::decode(&e.key, &e.value).unwrap();
        if r.status == "running" {
            running.insert(r.id.clone());
        } else {
            running.remove(&r.id);
        }
        if r.status == "completed" {
            done += 1;
        }
        peak = peak.max(running.len());
        assert!(
            running.len() <= 2,
            "{} jobs running on a worker with 2 slots",
            running.len()
        );
    }
    assert_eq!(peak, 2, "both slots were used");
    stop.cancel();
    w.wait().await.unwrap();
}

#[tokio::test]
async fn an_event_larger_than_a_nats_message_is_kept_beside_and_read_back_whole() {
    let env = Fleet::start().await;
    let mut f = env
        .events
        .claim_marker("big-journal", 1, "a", json!({}))
        .await
        .unwrap();
    // A transcript thread after a long warm retry: 2.5 MiB, past the
    // server's 1 MiB message limit.
    let thread: Vec<String> = (0..2500)
        .map(|i| format!("{i:04}-{}", "m".repeat(1000)))
        .collect();
    f.publish("journal", json!({"thread": thread}))
        .await
        .unwrap();
    f.publish("section", json!({"n": 1})).await.unwrap();
    let evs = env.events_of("big-journal").await;
    let journal = evs.iter().find(|e| e.r#type == "journal").unwrap();
    assert_eq!(journal.data_map()["thread"].as_array().unwrap().len(), 2500);
    assert_eq!(
        journal.data_map()["thread"][2499].as_str().unwrap(),
        thread[2499]
    );
    // The stored event itself is small; the fence saw it like any other.
    let mut s = env.conn.js.get_stream("LH_EVENTS").await.unwrap();
    assert!(s.info().await.unwrap().state.bytes < 64 * 1024);
}

/// The exact moment between a worker's two looks at a ticket's owner: B
/// finds A alive and indexes A's job to settle its ticket; A's session ends
/// before that index entry lands, so the session's end (handled by another
/// worker, C; no reaper runs) finds nothing to recover. B must not then ack
/// the ticket on its first look: it looks again after its index write and,
/// the owner gone, reclaims the job. (Acking on the first look stranded the
/// job with no ticket and no session end left to recover it.)
#[tokio::test]
async fn an_owner_whose_session_ends_while_its_ticket_is_settled_is_still_recovered() {
    let env = Fleet::start().await;
    let bucket = env.conn.layout.active_bucket();
    let id = "settling";
    let index_key = format!("$KV.{bucket}.run.worker-a.{id}");
    // A's index writes are lost, so its ticket comes back while it runs;
    // its one slot busy, A does not pull it.
    let proxy_a = leasehold_harness::FaultProxy::start(&env.url()).await;
    proxy_a.drop_matching(&index_key);
    let mut a = env.worker_proc(
        &["--worker-id", "worker-a", "--concurrency", "1"],
        // A short session: its end comes well within B's write timeout,
        // so B's held index write lands rather than failing.
        &[
            ("NATS_URL", proxy_a.url()),
            ("LH_SESSION_TIMEOUT", "1s".into()),
        ],
    );
    // C handles ended sessions (it serves another kind: the ticket is not its).
    let mut oc = env.opts();
    oc.kinds = vec!["echo".into()];
    let (c, stop_c) = env.worker_with(oc).await;
    env.submit("sleep", json!({"input": {"ms": 60000}}), id)
        .await;
    env.wait_for(id, Duration::from_secs(15), |r| {
        r.status == "running" && r.worker_id.as_deref() == Some("worker-a")
    })
    .await;
    // B gets the ticket back, finds A alive and indexes the job: held (its
    // connection stalls, so its session is long enough to outlast that).
    let proxy_b = leasehold_harness::FaultProxy::start(&env.url()).await;
    let hold_b = proxy_b.hold(&index_key);
    let mut ob = env.opts();
    ob.nats.url = proxy_b.url();
    ob.session_timeout = Duration::from_secs(20);
    let (b, stop_b) = env.worker_with(ob).await;
    tokio::time::timeout(Duration::from_secs(20), hold_b.triggered())
        .await
        .unwrap_or_else(|_| panic!("B never settled A's ticket:\n{}", a.output()));
    // A dies; its session ends and C handles that end (nothing indexed).
    a.kill9();
    // The server's marker of the session's end (its TTL ran out): the end
    // the watchers handle.
    let sessions = env.conn.layout.sessions_bucket();
    let s = env
        .conn
        .js
        .get_stream(format!("KV_{sessions}"))
        .await
        .unwrap();
    let subject = format!("$KV.{sessions}.worker-a");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let ended_at = loop {
        if let Ok(m) = s.get_last_raw_message_by_subject(&subject).await {
            if m.headers.get("Nats-Marker-Reason").is_some()
                || m.headers
                    .get("KV-Operation")
                    .is_some_and(|op| matches!(op.as_str(), "DEL" | "PURGE"))
            {
                break m.sequence;
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "A's session never ended"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let mut watch: async_nats::jetstream::consumer::PullConsumer = s
        .get_consumer(&env.conn.layout.session_watch_consumer())
        .await
        .unwrap();
    loop {
        let i = watch.info().await.unwrap();
        if i.ack_floor.stream_sequence >= ended_at && i.num_ack_pending == 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the end of A's session was never handled: {i:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        env.record(id).await.unwrap().epoch,
        1,
        "nobody recovered the job from the session's end: the moment is the one meant"
    );
    // Now B's index write lands: B looks again and takes the job.
    hold_b.release();
    let rec = env
        .wait_for(id, Duration::from_secs(15), |r| {
            r.status == "running" && r.worker_id.as_deref() == Some(b.worker_id.as_str())
        })
        .await;
    assert_eq!((rec.epoch, rec.stale_reclaims), (2, 1), "{rec:?}");
    stop_b.cancel();
    stop_c.cancel();
    b.wait().await.unwrap();
    c.wait().await.unwrap();
}
