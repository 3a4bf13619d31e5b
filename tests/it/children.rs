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

/// The output of a finished `fanout` job.
async fn output(env: &Fleet, id: &str, within: Duration) -> Value {
    let done = env.wait_status(id, "completed", within).await;
    serde_json::from_str(&done.result.as_ref().unwrap().output).unwrap()
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
        [&json!({"text": "a"}), &json!({"text": "b"}), &json!({"text": "c"})],
        "each child's result, in the order of the inputs"
    );
    let recs = each_child_once(&env, "brood-1", &children).await;
    for r in &recs {
        assert_eq!(r.spec.as_ref().unwrap().parent.as_ref().unwrap().depth, 1);
        assert_eq!(r.spec.as_ref().unwrap().parent.as_ref().unwrap().step, "spawn:echo#0");
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
