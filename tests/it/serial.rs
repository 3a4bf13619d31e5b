//! Servers that serve one request at a time (issue 37): the sim's
//! `--serve interrupts` (a newcomer cuts the stream in flight, as
//! llama-cpp-python's server does by default) and `serialized` (it waits),
//! against real worker processes on a real nats-server.
//!
//! Two experts in parallel cut each other's streams until a worker learns
//! the provider key's concurrency of 1; the job then loses no section, and
//! the fleet's other workers take it from `lh_flow` (nobody else needs to
//! see a cut). `model check` tells the three servers apart.

use std::time::Duration;

use leasehold_proto::JobEvent;
use leasehold_testkit::doors::flow::provider_key;
use leasehold_testkit::doors::flow::FlowStore;
use serde_json::{json, Value};

use leasehold_testkit::*;

/// Streams long enough that two experts overlap (a section is a few
/// hundred tokens, a tool proposal a handful of chunks).
const TOKEN_DELAY_MS: &str = "5";

async fn interrupting_sim() -> (leasehold_harness::Proc, String) {
    spawn_sim(&[
        ("LH_SIM_SERVE", "interrupts".into()),
        ("LH_SIM_TOKEN_DELAY_MS", TOKEN_DELAY_MS.into()),
    ])
    .await
}

fn key_of(sim: &str) -> String {
    provider_key(&format!("{sim}/v1"), "sim-1", None).0
}

async fn submit_two_by_two(env: &Fleet, id: &str) {
    env.submit(
        "research",
        json!({"input": {"topic": format!("one request at a time {id}"), "experts": 2, "sections": 2}}),
        id,
    )
    .await;
}

/// The job's record once it ended, completed with nothing skipped and no
/// attempt spent; and its events, up to its `completed` event.
async fn completed_whole(env: &Fleet, id: &str) -> Vec<JobEvent> {
    let rec = env
        .wait_for(id, Duration::from_secs(90), |r| {
            matches!(
                r.status.as_str(),
                "completed" | "failed" | "parked" | "dead"
            )
        })
        .await;
    assert_eq!(rec.status, "completed", "{id}: {rec:?}");
    let res = rec.result.as_ref().expect("a result");
    assert!(
        !res.partial && res.skipped_sections.is_empty(),
        "{id}: sections skipped: {:?}",
        res.skipped_sections
    );
    assert_eq!(rec.attempts, 0, "{id}: {rec:?}");
    env.wait_event(id, "completed", Duration::from_secs(10))
        .await
}

/// The `retry` events' reasons.
fn retries(events: &[JobEvent]) -> Vec<String> {
    events
        .iter()
        .filter(|e| e.r#type == "retry")
        .map(|e| e.data_map()["reason"].as_str().unwrap_or("").to_string())
        .collect()
}

async fn stats(sim: &str) -> Value {
    sim_json(sim, "GET", "/stats", None).await
}

async fn limits_row(env: &Fleet, id: &str) -> Value {
    let (code, out, err) = cli(&env.url(), &["limits", "list", "--json"]).await;
    assert_eq!(code, 0, "{err}");
    out.lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .find(|r| r["id"] == id)
        .unwrap_or_else(|| panic!("no row for {id} in {out}"))
}

/// Two experts × two sections on a server that cuts the stream in flight
/// for a newcomer: two cuts (each a sign, neither an attempt), then the
/// key's concurrency is 1 and the experts take turns. Nothing is skipped,
/// the `retry` events say what was learned, `limits list` shows it with its
/// reason, and `limits clear --concurrency` forgets it.
#[tokio::test]
async fn serial_two_experts_on_a_server_that_interrupts_lose_no_section() {
    let env = Fleet::start().await;
    let (_sim, sim) = interrupting_sim().await;
    let _w = research_worker(&env, &sim, &format!("{sim}/v1"), &[("LH_WORKER_ID", "w-a")]);
    submit_two_by_two(&env, "ser-1").await;
    let events = completed_whole(&env, "ser-1").await;
    let s = stats(&sim).await;
    let reasons = retries(&events);
    assert_eq!(s["serve"], "interrupts");
    // Learned at the second cut; one at a time after it.
    assert_eq!(s["interrupted"], 2, "{s}\n{reasons:#?}");
    assert_eq!(reasons.len(), 2, "{reasons:#?}");
    assert!(reasons[0].contains("(1 of 2"), "{reasons:#?}");
    assert!(
        reasons[1]
            .contains("serves one request at a time; concurrency 1 from now on, for the fleet"),
        "{reasons:#?}"
    );
    assert!(reasons.iter().all(|r| r.contains("not an attempt")));

    let id = key_of(&sim);
    let row = limits_row(&env, &id).await;
    assert_eq!(row["learned"]["concurrency"], 1, "{row}");
    assert_eq!(row["learned"]["by"], "w-a", "{row}");
    assert_eq!(row["learned"]["applies"], true, "{row}");
    assert!(
        row["learned"]["reason"]
            .as_str()
            .unwrap()
            .contains("while another request waited: it serves one request at a time"),
        "{row}"
    );
    // The table says it too.
    let (code, table, _) = cli(&env.url(), &["limits", "list"]).await;
    assert_eq!(code, 0);
    assert!(table.contains("concurrency 1 learned by w-a"), "{table}");

    let (code, out, err) = cli(&env.url(), &["limits", "clear", &id, "--concurrency"]).await;
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(
        serde_json::from_str::<Value>(&out).unwrap()["learned_cleared"]["concurrency"],
        1
    );
    let store = FlowStore::open(&env.conn).await.unwrap();
    assert!(store.get_learned(&id).await.unwrap().is_none());
    let (code, _, _) = cli(&env.url(), &["limits", "clear", &id, "--concurrency"]).await;
    assert_eq!(code, 1, "nothing left to clear");
}

/// A fleet of two: worker A learns the limit from its own job's cuts;
/// worker B, started after, takes it from `lh_flow` before its first job.
/// Then one job on each at once: the leases split the one slot between
/// them, so the server (which would cut any overlap) cuts nothing more.
#[tokio::test]
async fn serial_a_fleet_of_two_learns_the_limit_from_one_workers_evidence() {
    let env = Fleet::start().await;
    let (_sim, sim) = interrupting_sim().await;
    let base = format!("{sim}/v1");
    let one_job = ("LH_CONCURRENCY", "1");
    let _a = research_worker(&env, &sim, &base, &[("LH_WORKER_ID", "w-a"), one_job]);
    submit_two_by_two(&env, "fleet-1").await;
    let events = completed_whole(&env, "fleet-1").await;
    let cut = stats(&sim).await["interrupted"].as_u64().unwrap();
    assert_eq!(cut, 2, "{:#?}", retries(&events));
    let id = key_of(&sim);
    let store = FlowStore::open(&env.conn).await.unwrap();
    let (learned, _) = store
        .get_learned(&id)
        .await
        .unwrap()
        .expect("published for the fleet");
    assert_eq!((learned.concurrency, learned.by.as_str()), (1, "w-a"));

    let b = research_worker(&env, &sim, &base, &[("LH_WORKER_ID", "w-b"), one_job]);
    wait_log(&b, "provider concurrency learned", Duration::from_secs(20)).await;
    submit_two_by_two(&env, "fleet-2").await;
    submit_two_by_two(&env, "fleet-3").await;
    let mut ran_on = Vec::new();
    for j in ["fleet-2", "fleet-3"] {
        let events = completed_whole(&env, j).await;
        assert!(retries(&events).is_empty(), "{j}: {:?}", retries(&events));
        // Who completed it (the owner publishes its `completed` event).
        let last = events.last().expect("the completed event");
        ran_on.push(last.worker_id.clone().unwrap_or_default());
    }
    ran_on.sort();
    assert_eq!(ran_on, ["w-a", "w-b"], "one job on each worker");
    let s = stats(&sim).await;
    assert_eq!(
        s["interrupted"], cut,
        "no cut after the fleet learned one at a time: {s}"
    );
    // B saw no cut of its own: what it knows is A's record.
    assert!(
        !b.output().contains("concurrency 1 from now on"),
        "{}",
        b.output()
    );
}

/// Set by hand, one at a time from the first request: no cut at all, and
/// nothing learned. A bad value stops the worker at start, naming it.
#[tokio::test]
async fn serial_model_concurrency_set_by_hand_and_bad_values() {
    let env = Fleet::start().await;
    let (_sim, sim) = interrupting_sim().await;
    let base = format!("{sim}/v1");
    for v in ["0", "two", "-1", "1.5"] {
        let mut w = research_worker(&env, &sim, &base, &[("LH_MODEL_CONCURRENCY", v)]);
        let st = w.wait_timeout(Duration::from_secs(10));
        assert_eq!(st.and_then(|s| s.code()), Some(2), "{v}: {}", w.output());
        assert!(
            w.output().contains(&format!(
                "LH_MODEL_CONCURRENCY={v}: expected a whole number"
            )),
            "{}",
            w.output()
        );
    }
    let _w = research_worker(&env, &sim, &base, &[("LH_MODEL_CONCURRENCY", "1")]);
    submit_two_by_two(&env, "hand-1").await;
    let events = completed_whole(&env, "hand-1").await;
    assert!(retries(&events).is_empty(), "{:?}", retries(&events));
    assert_eq!(stats(&sim).await["interrupted"], 0);
    let store = FlowStore::open(&env.conn).await.unwrap();
    assert!(store.get_learned(&key_of(&sim)).await.unwrap().is_none());
}

async fn model_check(sim: &str, extra: &[(&str, &str)]) -> (i32, Value, String) {
    let mut cmd = tokio::process::Command::new(leasehold_harness::bin_path("leasehold"));
    cmd.args(["model", "check", "--probe", "concurrency"])
        .env("LH_MODEL_BASE_URL", format!("{sim}/v1"))
        .env("LH_MODEL", "sim-1");
    for (k, v) in extra {
        cmd.env(k, v);
    }
    let out = tokio::time::timeout(Duration::from_secs(60), cmd.output())
        .await
        .expect("model check hung")
        .expect("run leasehold model check");
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let report = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    (
        out.status.code().unwrap_or(-1),
        report,
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

/// `model check` sends two overlapping streams and tells the three servers
/// apart; on one that serves one request at a time it says what to set,
/// and with a concurrency above 1 set by hand against one that cuts
/// streams, research would lose sections: exit 1.
#[tokio::test]
async fn serial_model_check_reports_how_the_server_serves_two_requests() {
    for mode in ["parallel", "serialized", "interrupts"] {
        let (_sim, sim) = spawn_sim(&[
            ("LH_SIM_SERVE", mode.into()),
            ("LH_SIM_TOKEN_DELAY_MS", "5".into()),
        ])
        .await;
        let (code, report, err) = model_check(&sim, &[]).await;
        let pretty = serde_json::to_string_pretty(&report).unwrap();
        let c = &report["capabilities"]["concurrency"];
        assert_eq!(c["status"], mode, "{pretty}");
        assert_eq!(code, 0, "{pretty}\n{err}");
        let w = &report["workload"];
        assert_eq!(w["runs"], true, "{pretty}");
        let set: Vec<&str> = w["set"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(Value::as_str)
            .collect();
        if mode == "parallel" {
            assert!(c.get("set").is_none(), "{pretty}");
            assert!(!set.contains(&"LH_MODEL_CONCURRENCY=1"), "{pretty}");
        } else {
            assert_eq!(c["set"], "LH_MODEL_CONCURRENCY=1", "{pretty}");
            assert!(set.contains(&"LH_MODEL_CONCURRENCY=1"), "{pretty}");
            assert!(
                w["why"].as_str().unwrap().contains("one request at a time"),
                "{pretty}"
            );
        }
        if mode == "interrupts" {
            assert!(
                w["why"]
                    .as_str()
                    .unwrap()
                    .contains("cuts the stream in flight"),
                "{pretty}"
            );
            let (code, report, err) = model_check(&sim, &[("LH_MODEL_CONCURRENCY", "3")]).await;
            let pretty = serde_json::to_string_pretty(&report).unwrap();
            assert_eq!(code, 1, "{pretty}");
            assert_eq!(report["workload"]["runs"], false, "{pretty}");
            assert!(
                report["workload"]["why"]
                    .as_str()
                    .unwrap()
                    .contains("LH_MODEL_CONCURRENCY=3: research's experts would cut each other's streams and lose sections"),
                "{pretty}"
            );
            assert!(err.contains("LH_MODEL_CONCURRENCY=1"), "{err}");
            // Set to 1: nothing to say.
            let (code, report, _) = model_check(&sim, &[("LH_MODEL_CONCURRENCY", "1")]).await;
            assert_eq!(code, 0);
            assert!(
                !report["workload"]["why"]
                    .as_str()
                    .unwrap()
                    .contains("one request at a time"),
                "{report}"
            );
        }
    }
}
