//! Child jobs (`ctx.spawn_many`, `ctx.join`; the built-in `fanout` kind):
//! a parent that joins holds no worker while its children run and is woken
//! once, by the last child's end, with every outcome (a failure is one); a
//! cancel of the parent cancels its children unless they were detached;
//! depth and fan-out limits are clear errors; and a parent killed or paused
//! at the moments that matter never starts a child twice.

use std::time::Duration;

use leasehold_harness::FaultProxy;
use leasehold_proto::{JobEvent, JobRecord};
use leasehold_testkit::{cli, wait_log, Fleet};
use serde_json::{json, Value};

/// The output of a finished `fanout` job (read whole: one over 16 KiB is
/// kept beside its record).
async fn output(env: &Fleet, id: &str, within: Duration) -> Value {
    env.wait_status(id, "completed", within).await;
    let done = env.record(id).await.expect("its record");
    let out = &done.result.as_ref().unwrap().output;
    serde_json::from_str(out).unwrap_or_else(|e| panic!("{id}'s output: {e}: {out:?}"))
}

/// The ids of the children a `fanout` output lists.
fn children_of(out: &Value) -> Vec<String> {
    out["children"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_str().unwrap().to_string())
        .collect()
}

fn of_type<'a>(evs: &'a [JobEvent], ty: &str) -> Vec<&'a JobEvent> {
    evs.iter().filter(|e| e.r#type == ty).collect()
}

/// Each child exists once, named its parent, and ran once.
async fn each_child_once(env: &Fleet, parent: &str, children: &[String]) -> Vec<JobRecord> {
    let mut out = Vec::new();
    for c in children {
        let rec = env.record(c).await.expect("the child exists");
        let p = rec.spec.as_ref().unwrap().parent.clone().unwrap();
        assert_eq!(p.id, parent, "{rec:?}");
        let claims = of_type(&env.events_of(c).await, "claimed").len();
        assert_eq!(claims, 1, "child {c} ran once: {rec:?}");
        out.push(rec);
    }
    out
}

/// A worker's options: these built-in kinds, this many slots.
fn slots(env: &Fleet, kinds: &[&str], n: usize) -> leasehold::Options {
    let mut o = env.opts();
    o.kinds = kinds.iter().map(|k| k.to_string()).collect();
    o.concurrency = n;
    o
}

#[tokio::test]
async fn a_parent_waits_for_its_children_without_a_slot_and_wakes_once_with_every_outcome() {
    let env = Fleet::start().await;
    // One slot: the children can only run while their parent holds none.
    let (w, stop) = env.worker_with(slots(&env, &["fanout", "echo"], 1)).await;
    env.submit(
        "fanout",
        json!({"input": {"inputs": [{"text": "a"}, {"text": "b"}, {"text": "c"}]}}),
        "brood-1",
    )
    .await;
    let out = output(&env, "brood-1", Duration::from_secs(30)).await;
    let children = children_of(&out);
    assert_eq!(children.len(), 3, "{out}");
    assert_eq!(out["completed"], json!(3), "{out}");
    let results: Vec<&Value> = out["outcomes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| &o["result"])
        .collect();
    assert_eq!(
        results,
        [
            &json!({"text": "a"}),
            &json!({"text": "b"}),
            &json!({"text": "c"})
        ],
        "each child's result, in the order of the inputs"
    );
    let recs = each_child_once(&env, "brood-1", &children).await;
    for r in &recs {
        assert_eq!(r.spec.as_ref().unwrap().parent.as_ref().unwrap().depth, 1);
        assert_eq!(
            r.spec.as_ref().unwrap().parent.as_ref().unwrap().step,
            "spawn:echo#0"
        );
    }
    let evs = env.events_of("brood-1").await;
    let waits = of_type(&evs, "waiting");
    assert_eq!(waits.len(), 1, "one wait: {evs:?}");
    assert_eq!(waits[0].data_map()["for"], json!("children"));
    assert_eq!(
        of_type(&evs, "claimed").len(),
        2,
        "its first attempt and one wake, whatever the number of children: {evs:?}"
    );
    assert_eq!(env.steps_recorded("brood-1", "spawn:echo#0").await, 1);
    assert_eq!(env.steps_recorded("brood-1", "join#0").await, 1);
    stop.cancel();
    w.wait().await.unwrap();
}

#[tokio::test]
async fn a_childs_failure_is_an_outcome_the_parent_sees_and_many_ends_at_once_wake_it_once() {
    let env = Fleet::start().await;
    let (w, stop) = env
        .worker_with(slots(&env, &["fanout", "echo", "fail"], 8))
        .await;
    // Twenty children ending side by side on eight slots, two of them
    // failing for good.
    let inputs: Vec<Value> = (0..20)
        .map(|i| match i {
            3 | 11 => json!({"class": "terminal", "times": 99}),
            _ => json!({"class": "terminal", "times": 0}),
        })
        .collect();
    env.submit(
        "fanout",
        json!({"input": {"kind": "fail", "inputs": inputs}}),
        "brood-fail",
    )
    .await;
    let out = output(&env, "brood-fail", Duration::from_secs(60)).await;
    assert_eq!(out["completed"], json!(18), "{out}");
    let failed: Vec<&Value> = out["outcomes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|o| o["status"] == "failed")
        .collect();
    assert_eq!(failed.len(), 2, "{out}");
    for f in failed {
        assert_eq!(f["error"]["class"], json!("terminal"), "{f}");
        assert!(
            f["error"]["message"]
                .as_str()
                .unwrap()
                .contains("injected failure"),
            "{f}"
        );
        assert!(f.get("result").is_none(), "{f}");
    }
    let evs = env.events_of("brood-fail").await;
    assert_eq!(
        of_type(&evs, "claimed").len(),
        2,
        "twenty ends, one wake: {evs:?}"
    );
    let children = children_of(&out);
    each_child_once(&env, "brood-fail", &children).await;
    stop.cancel();
    w.wait().await.unwrap();
}

#[tokio::test]
async fn cancelling_a_parent_cancels_its_children_and_detached_ones_run_on() {
    let env = Fleet::start().await;
    let (w, stop) = env.worker_with(slots(&env, &["fanout", "sleep"], 8)).await;
    let long = json!({"ms": 60000});
    env.submit(
        "fanout",
        json!({"input": {"kind": "sleep", "inputs": [long, long]}}),
        "brood-cascade",
    )
    .await;
    env.submit(
        "fanout",
        json!({"input": {"kind": "sleep", "inputs": [{"ms": 1500}], "detach": true}}),
        "brood-detached",
    )
    .await;
    for id in ["brood-cascade", "brood-detached"] {
        env.wait_status(id, "waiting", Duration::from_secs(20))
            .await;
    }
    let cascade = env.spawned("brood-cascade").await;
    let detached = env.spawned("brood-detached").await;
    for c in &cascade {
        env.wait_status(c, "running", Duration::from_secs(20)).await;
    }
    // `leasehold list --status waiting` says what the parent waits for.
    let (code, list, err) = cli(&env.url(), &["list", "--status", "waiting"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(
        list.lines()
            .any(|l| l.contains("brood-cascade") && l.contains("for its children (join#0)")),
        "{list}"
    );
    for id in ["brood-cascade", "brood-detached"] {
        let (code, out, err) = cli(&env.url(), &["cancel", id]).await;
        assert_eq!(code, 0, "{out}{err}");
    }
    for c in &cascade {
        let r = env
            .wait_status(c, "cancelled", Duration::from_secs(20))
            .await;
        assert!(r.cancel_requested, "{r:?}");
    }
    env.wait_status("brood-cascade", "cancelled", Duration::from_secs(5))
        .await;
    // The detached child was not asked to stop: it runs to its end, and
    // its end is not announced to a parent that ended.
    let d = env
        .wait_status(&detached[0], "completed", Duration::from_secs(20))
        .await;
    assert!(!d.cancel_requested, "{d:?}");
    let ends = leasehold_testkit::doors::signals::Signals::new(&env.conn)
        .count("brood-detached", "lh-child")
        .await
        .unwrap();
    assert_eq!(ends, 0, "a cancelled parent is told nothing");
    stop.cancel();
    w.wait().await.unwrap();
}

#[tokio::test]
async fn spawn_limits_and_bad_spawns_are_clear_errors() {
    let env = Fleet::start().await;
    let (w, stop) = env.worker_with(slots(&env, &["fanout", "echo"], 4)).await;
    // A chain nine deep: the job at depth 8 may not spawn a ninth.
    env.submit("fanout", json!({"input": {"nest": 9}}), "chain")
        .await;
    let top = output(&env, "chain", Duration::from_secs(60)).await;
    let mut o = top["outcomes"][0].clone();
    let mut depth = 1;
    while o["status"] == "completed" {
        o = o["result"]["outcomes"][0].clone();
        depth += 1;
    }
    assert_eq!(depth, 8, "the eighth child failed: {top}");
    assert_eq!(o["status"], json!("failed"), "{o}");
    let why = o["error"]["message"].as_str().unwrap();
    assert!(
        why.contains("depth 9") && why.contains("limit of 8"),
        "{why}"
    );
    // A kind name that cannot be one.
    env.submit(
        "fanout",
        json!({"input": {"kind": "no.such", "n": 1}}),
        "bad-kind",
    )
    .await;
    let r = env
        .wait_status("bad-kind", "failed", Duration::from_secs(20))
        .await;
    let why = r.error.unwrap().message;
    assert!(why.contains("not a kind name"), "{why}");
    // More children in one spawn than a spawn may start.
    env.submit("fanout", json!({"input": {"n": 10_001}}), "too-many")
        .await;
    let r = env
        .wait_status("too-many", "failed", Duration::from_secs(20))
        .await;
    let why = r.error.unwrap().message;
    assert!(
        why.contains("10001 children") && why.contains("limit of 10000"),
        "{why}"
    );
    assert_eq!(
        env.steps_recorded("too-many", "spawn:echo#0").await,
        0,
        "nothing was spawned"
    );
    // A kind no worker set up.
    env.submit(
        "fanout",
        json!({"input": {"kind": "ghost", "n": 1}}),
        "ghost-kind",
    )
    .await;
    let r = env
        .wait_status("ghost-kind", "failed", Duration::from_secs(30))
        .await;
    assert_eq!(r.attempts, 1, "never retried: {r:?}");
    let why = r.error.unwrap().message;
    assert!(
        why.contains("refused") && why.contains("unknown kind"),
        "{why}"
    );
    stop.cancel();
    w.wait().await.unwrap();
}

/// A `fanout` parent on a worker process of its own (`fanout` only: its
/// children wait for another worker), connected through `url`.
fn parent_worker(env: &Fleet, url: &str, name: &str) -> leasehold_harness::Proc {
    env.worker_proc(
        &["--worker-id", name],
        &[("LH_KINDS", "fanout".into()), ("NATS_URL", url.to_string())],
    )
}

/// What each fault test ends with: a worker for the children and the
/// parent's next attempt, a reaper to end the dead owner's session, the
/// parent done, each child once, its spawn recorded once.
async fn finishes_with_each_child_once(env: &Fleet, parent: &str) {
    let (w, stop) = env.worker_with(slots(env, &["fanout", "echo"], 4)).await;
    let (r, stop_r) = env.reaper().await;
    let out = output(env, parent, Duration::from_secs(60)).await;
    let children = children_of(&out);
    assert_eq!(children.len(), 3, "{out}");
    assert_eq!(out["completed"], json!(3), "{out}");
    each_child_once(env, parent, &children).await;
    assert_eq!(env.steps_recorded(parent, "spawn:echo#0").await, 1);
    let evs = env.events_of(parent).await;
    assert_eq!(of_type(&evs, "completed").len(), 1, "{evs:?}");
    // Its children ended while it was re-claimed: it waited at most once,
    // and was claimed for its first attempt, its reclaim and each wait's
    // wake, no more.
    let waits = of_type(&evs, "waiting").len();
    assert!(waits <= 1, "{evs:?}");
    assert_eq!(of_type(&evs, "claimed").len(), 2 + waits, "{evs:?}");
    stop.cancel();
    stop_r.cancel();
    w.wait().await.unwrap();
    r.wait().await.unwrap();
}

#[tokio::test]
async fn a_parent_killed_after_publishing_its_children_and_before_recording_the_spawn_starts_each_once(
) {
    let env = Fleet::start().await;
    let proxy = FaultProxy::start(&env.url()).await;
    // The spawn's step record is the first step event: held, the worker
    // is killed with its children published and its spawn unrecorded.
    let hold = proxy.hold("lh.events.brood-k1.step");
    let mut a = parent_worker(&env, &proxy.url(), "brood-a");
    wait_log(&a, "worker starting", Duration::from_secs(20)).await;
    env.submit("fanout", json!({"input": {"n": 3}}), "brood-k1")
        .await;
    tokio::time::timeout(Duration::from_secs(15), hold.triggered())
        .await
        .expect("the parent reached its spawn's record");
    assert_eq!(
        proxy.published("lh.submit.>"),
        3,
        "the three children were published before the record"
    );
    a.kill9();
    finishes_with_each_child_once(&env, "brood-k1").await;
}

#[tokio::test]
async fn a_parent_killed_after_its_spawn_and_before_its_wait_was_written_starts_each_once() {
    let env = Fleet::start().await;
    let proxy = FaultProxy::start(&env.url()).await;
    let mut a = parent_worker(&env, &proxy.url(), "brood-a");
    wait_log(&a, "worker starting", Duration::from_secs(20)).await;
    env.submit(
        "fanout",
        json!({"input": {"n": 3, "pause_ms": 1500}}),
        "brood-k2",
    )
    .await;
    env.wait_event("brood-k2", "step", Duration::from_secs(15))
        .await;
    // The spawn is recorded; the next write of the parent's record is its
    // wait (after the pause): held, and the worker killed.
    let hold = proxy.hold("$KV.lh_jobs.brood-k2");
    tokio::time::timeout(Duration::from_secs(15), hold.triggered())
        .await
        .expect("the parent reached its wait's write");
    assert_eq!(env.record("brood-k2").await.unwrap().status, "running");
    a.kill9();
    finishes_with_each_child_once(&env, "brood-k2").await;
}

#[tokio::test]
async fn a_stale_parent_resumed_after_its_children_ended_spawns_nothing_and_writes_nothing() {
    let env = Fleet::start().await;
    let mut a = parent_worker(&env, &env.url(), "brood-a");
    wait_log(&a, "worker starting", Duration::from_secs(20)).await;
    env.submit(
        "fanout",
        json!({"input": {"n": 3, "pause_ms": 30000}}),
        "brood-stale",
    )
    .await;
    env.wait_event("brood-stale", "step", Duration::from_secs(15))
        .await;
    a.stop();
    finishes_with_each_child_once(&env, "brood-stale").await;
    let done = env.record("brood-stale").await.unwrap();
    a.cont();
    wait_log(&a, "ownership lost", Duration::from_secs(40)).await;
    assert_eq!(env.record("brood-stale").await.unwrap(), done);
    let out = output(&env, "brood-stale", Duration::from_secs(1)).await;
    each_child_once(&env, "brood-stale", &children_of(&out)).await;
    assert_eq!(env.steps_recorded("brood-stale", "spawn:echo#0").await, 1);
    a.kill9();
}

#[tokio::test]
async fn a_child_whose_worker_died_between_its_end_and_its_announcement_still_wakes_its_parent() {
    let env = Fleet::start().await;
    let (p, stop_p) = env.worker_with(slots(&env, &["fanout"], 1)).await;
    let proxy = FaultProxy::start(&env.url()).await;
    // The child's end reaches the parent first: held, and its worker
    // killed with the child's record `completed`, nothing announced and no
    // terminal event.
    let hold = proxy.hold("lh.signal.brood-k4.lh-child");
    let mut b = env.worker_proc(
        &["--worker-id", "child-b"],
        &[("LH_KINDS", "sleep".into()), ("NATS_URL", proxy.url())],
    );
    wait_log(&b, "worker starting", Duration::from_secs(20)).await;
    // A child that takes a while: its parent waits for it by then.
    env.submit(
        "fanout",
        json!({"input": {"kind": "sleep", "inputs": [{"ms": 1500}]}}),
        "brood-k4",
    )
    .await;
    tokio::time::timeout(Duration::from_secs(20), hold.triggered())
        .await
        .expect("the child's worker reached its announcement");
    b.kill9();
    let child = env.spawned("brood-k4").await.remove(0);
    assert_eq!(env.record(&child).await.unwrap().status, "completed");
    assert!(of_type(&env.events_of(&child).await, "completed").is_empty());
    assert_eq!(env.record("brood-k4").await.unwrap().status, "waiting");
    // Recovery finishes the child's end: announced, then its event.
    let (r, stop_r) = env.reaper().await;
    let out = output(&env, "brood-k4", Duration::from_secs(60)).await;
    assert_eq!(out["completed"], json!(1), "{out}");
    let ends = of_type(&env.events_of(&child).await, "completed")
        .into_iter()
        .map(|e| e.data_map())
        .collect::<Vec<_>>();
    assert_eq!(ends.len(), 1, "{ends:?}");
    assert!(ends[0].contains_key("recovered_by"), "{ends:?}");
    let evs = env.events_of("brood-k4").await;
    assert_eq!(of_type(&evs, "claimed").len(), 2, "woken once: {evs:?}");
    stop_r.cancel();
    r.wait().await.unwrap();
    stop_p.cancel();
    p.wait().await.unwrap();
}

#[tokio::test]
async fn the_console_shows_a_parents_children_with_their_states_and_a_childs_parent() {
    let env = Fleet::start().await;
    let (w, stop) = env.worker_with(slots(&env, &["fanout", "echo"], 4)).await;
    env.submit("fanout", json!({"input": {"n": 3}}), "brood-ui")
        .await;
    let out = output(&env, "brood-ui", Duration::from_secs(30)).await;
    let kids = children_of(&out);
    let console = crate::console::spawn_console(&env, &[]).await;
    let mut b = crate::console::Browser::start().await;
    b.goto(&format!("{}/jobs/brood-ui", console.base)).await;
    b.wait(
        "document.querySelectorAll('#children li').length === 3 && document.querySelector('h2 small').innerText.includes('3 completed')",
        Duration::from_secs(10),
        "the parent's three children, completed",
    )
    .await;
    let links = b
        .eval("Array.from(document.querySelectorAll('#children li a')).map(a => a.getAttribute('href'))")
        .await;
    let want: Vec<String> = kids.iter().map(|k| format!("/jobs/{k}")).collect();
    assert_eq!(links, json!(want));
    b.goto(&format!("{}/jobs/{}", console.base, kids[0])).await;
    b.wait(
        "document.querySelector('#parent') && document.querySelector('#parent').getAttribute('href') === '/jobs/brood-ui'",
        Duration::from_secs(10),
        "the child's page links its parent",
    )
    .await;
    stop.cancel();
    w.wait().await.unwrap();
}

#[tokio::test]
async fn children_not_yet_claimed_when_their_parent_is_cancelled_never_run() {
    let env = Fleet::start().await;
    // Only the parent's kind is served: its children wait as tickets,
    // with no record for the cancel to find.
    let (p, stop_p) = env.worker_with(slots(&env, &["fanout"], 1)).await;
    env.submit(
        "fanout",
        json!({"input": {"kind": "sleep", "inputs": [{"ms": 60000}, {"ms": 60000}]}}),
        "brood-early",
    )
    .await;
    env.wait_status("brood-early", "waiting", Duration::from_secs(20))
        .await;
    let kids = env.spawned("brood-early").await;
    for k in &kids {
        assert!(env.record(k).await.is_none(), "not claimed yet");
    }
    let (code, out, err) = cli(&env.url(), &["cancel", "brood-early"]).await;
    assert_eq!(code, 0, "{out}{err}");
    env.wait_status("brood-early", "cancelled", Duration::from_secs(10))
        .await;
    // Their worker comes: each child is recorded cancelled, never run.
    let (w, stop) = env.worker_with(slots(&env, &["sleep"], 2)).await;
    for k in &kids {
        let r = env
            .wait_status(k, "cancelled", Duration::from_secs(20))
            .await;
        assert_eq!(r.epoch, 0, "never claimed to run: {r:?}");
        assert!(
            r.error.unwrap().message.contains("brood-early"),
            "it says why"
        );
    }
    stop.cancel();
    w.wait().await.unwrap();
    stop_p.cancel();
    p.wait().await.unwrap();
}

/// Submits `fanout` parent `id` of three children that sleep 1.5 s, and
/// waits until it waits for them.
async fn waiting_for_sleepers(env: &Fleet, id: &str) {
    let nap = json!({"ms": 1500});
    env.submit(
        "fanout",
        json!({"input": {"kind": "sleep", "inputs": [nap, nap, nap]}}),
        id,
    )
    .await;
    env.wait_status(id, "waiting", Duration::from_secs(30))
        .await;
}

#[tokio::test]
async fn the_clients_stream_of_a_parent_carries_its_wait_its_signals_and_each_childs_end_before_its_own(
) {
    let env = Fleet::start().await;
    let (w, stop) = env.worker_with(slots(&env, &["fanout", "sleep"], 4)).await;
    let console = crate::console::spawn_console(&env, &[]).await;
    waiting_for_sleepers(&env, "brood-sse").await;
    // While it waits for its children, a signal for it (kept, and shown).
    let (code, o, e) = cli(
        &env.url(),
        &["signal", "brood-sse", "note", "--data", r#"{"k":1}"#],
    )
    .await;
    assert_eq!(code, 0, "{o}{e}");
    let url = format!("{}/v1/jobs/brood-sse/events", console.base);
    let c = crate::console::http();
    let msgs =
        crate::console::sse_until(c.get(&url).send().await.unwrap(), |(_, e, _)| e == "end").await;
    let out = output(&env, "brood-sse", Duration::from_secs(30)).await;
    let kids = children_of(&out);
    let at = |t: &str| msgs.iter().position(|(_, _, d)| d["type"] == t);
    let waiting = at("waiting").expect("the waiting event");
    assert_eq!(msgs[waiting].2["for"], json!("children"), "{msgs:?}");
    let terminal = at("completed").expect("the terminal event");
    let mut ended: Vec<String> = Vec::new();
    for (i, (id, _, d)) in msgs.iter().enumerate().filter(|(_, m)| m.1 == "child") {
        assert!(id.is_none(), "a child's end has no event id");
        assert_eq!(d["status"], "completed", "{d}");
        assert!(d["seq"].as_u64().is_some() && d["at"].is_string(), "{d}");
        assert!(
            i < terminal,
            "each child's end before the parent's own: {msgs:?}"
        );
        ended.push(d["child"].as_str().unwrap().to_string());
    }
    ended.sort();
    let mut want = kids.clone();
    want.sort();
    assert_eq!(ended, want, "each child's end, once");
    let sig: Vec<&Value> = msgs
        .iter()
        .filter(|m| m.1 == "signal")
        .map(|m| &m.2)
        .collect();
    assert_eq!(sig.len(), 1, "{msgs:?}");
    assert_eq!(
        (&sig[0]["name"], &sig[0]["data"], sig[0]["id"].is_null()),
        (&json!("note"), &json!({"k": 1}), true)
    );
    stop.cancel();
    w.wait().await.unwrap();
}

#[tokio::test]
async fn watch_says_how_many_children_are_left_and_events_lists_the_tree_with_states() {
    let env = Fleet::start().await;
    let (w, stop) = env
        .worker_with(slots(&env, &["fanout", "sleep", "echo"], 4))
        .await;
    let url = env.url();
    // A parent whose three children sleep a moment: `watch` follows its wait.
    waiting_for_sleepers(&env, "brood-watch").await;
    let (code, out, err) = cli(&url, &["watch", "brood-watch"]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("waiting for its children (join#0)")
            && out.contains("3 children still to end")
            && out.contains("leasehold events brood-watch --children"),
        "{out}"
    );
    // A tree two levels deep: a fanout child spawning three echo children.
    env.submit("fanout", json!({"input": {"nest": 1}}), "brood-tree")
        .await;
    output(&env, "brood-tree", Duration::from_secs(30)).await;
    let (code, out, err) = cli(&url, &["events", "brood-tree", "--children"]).await;
    assert_eq!(code, 0, "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines.len(),
        5,
        "the parent, its child, three grandchildren:\n{out}"
    );
    assert!(
        lines[0].starts_with("brood-tree  fanout  completed"),
        "{out}"
    );
    assert!(
        lines[1].starts_with("└─ brood-tree_") && lines[1].ends_with("fanout  completed"),
        "{out}"
    );
    for l in &lines[2..4] {
        assert!(
            l.starts_with("   ├─ brood-tree_") && l.ends_with("echo  completed"),
            "{out}"
        );
    }
    assert!(
        lines[4].starts_with("   └─ ") && lines[4].ends_with("echo  completed"),
        "{out}"
    );
    let (_, shallow, _) = cli(
        &url,
        &["events", "brood-tree", "--children", "--depth", "1"],
    )
    .await;
    assert_eq!(shallow.lines().count(), 2, "{shallow}");
    let (_, js, _) = cli(&url, &["events", "brood-tree", "--children", "--json"]).await;
    let rows: Vec<Value> = js
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 4, "{js}");
    assert_eq!(
        (&rows[0]["parent"], &rows[0]["depth"], &rows[0]["kind"]),
        (&json!("brood-tree"), &json!(1), &json!("fanout"))
    );
    assert!(
        rows[1..]
            .iter()
            .all(|r| r["depth"] == 2 && r["parent"] == rows[0]["id"] && r["status"] == "completed"),
        "{js}"
    );
    // Bad input: a depth past the limit, a job that does not exist.
    let (code, _, err) = cli(
        &url,
        &["events", "brood-tree", "--children", "--depth", "9"],
    )
    .await;
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--depth"), "{err}");
    let (code, _, err) = cli(&url, &["events", "no-such-brood", "--children"]).await;
    assert_eq!(code, 1);
    assert!(err.contains("no job no-such-brood"), "{err}");
    let (_, none, _) = cli(
        &url,
        &[
            "events",
            lines[2].split_whitespace().nth(1).unwrap(),
            "--children",
        ],
    )
    .await;
    assert!(none.contains("(no children:"), "{none}");
    stop.cancel();
    w.wait().await.unwrap();
}

#[tokio::test]
async fn a_childs_result_reaches_its_parent_whole_small_large_or_kept_beside_its_record() {
    let env = Fleet::start().await;
    let (w, stop) = env.worker_with(slots(&env, &["fanout", "echo"], 4)).await;
    // A small result rides in the child's announcement; one over 4 KiB is
    // read from its record; one over 16 KiB is kept beside the record.
    let inputs =
        json!([{"text": "small"}, {"text": "m".repeat(6_000)}, {"text": "l".repeat(40_000)}]);
    env.submit(
        "fanout",
        json!({"input": {"inputs": inputs}}),
        "brood-sizes",
    )
    .await;
    let out = output(&env, "brood-sizes", Duration::from_secs(30)).await;
    let results: Vec<&Value> = out["outcomes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| &o["result"])
        .collect();
    let want: Vec<&Value> = inputs.as_array().unwrap().iter().collect();
    assert_eq!(results, want, "each result whole, in order");
    stop.cancel();
    w.wait().await.unwrap();
}
