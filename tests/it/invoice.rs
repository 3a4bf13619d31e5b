//! The invoice agent (`examples/invoice`, built on the public `leasehold`
//! SDK) against real processes: the accounting system of `leasehold-sim`,
//! real `invoice-worker` processes killed and paused at the moment that
//! matters. Whatever happens: exactly one invoice.

use std::time::Duration;

use leasehold::JobRecord;
use leasehold_harness::Proc;
use leasehold_testkit::SetupOptions;
use serde_json::{json, Value};

use leasehold_testkit::*;

async fn env() -> Fleet {
    let mut o = SetupOptions {
        ack_wait: ACK_WAIT,
        ..SetupOptions::default()
    };
    o.kinds.push("invoice".into());
    Fleet::with(o).await
}

fn worker(env: &Fleet, sim: &str, extra: &[(&'static str, &str)]) -> Proc {
    let mut e = env.proc_env();
    e.push(("LH_KINDS", "invoice".into()));
    e.push(("INVOICE_ACCOUNTING_URL", sim.to_string()));
    e.extend(extra.iter().map(|(k, v)| (*k, v.to_string())));
    Proc::spawn("invoice-worker", &[], &e)
}

async fn invoices(sim: &str) -> Vec<Value> {
    sim_json(sim, "GET", "/accounting/invoices", None)
        .await
        .as_array()
        .cloned()
        .unwrap_or_default()
}

async fn arm(sim: &str, mode: &str, times: u32) {
    sim_json(
        sim,
        "POST",
        "/accounting/faults",
        Some(json!({"mode": mode, "times": times})),
    )
    .await;
}

async fn submit(env: &Fleet, id: &str, extra: Value) {
    let mut input = json!({"email": {"from": "billing@acme.example", "body": "Hello,\nInvoice F-17 from ACME: 1,200.00 EUR, due in 30 days."}});
    if let (Some(i), Some(e)) = (input.as_object_mut(), extra.as_object()) {
        i.extend(e.clone());
    }
    env.submit("invoice", json!({"input": input}), id).await;
}

async fn ended(env: &Fleet, id: &str) -> JobRecord {
    env.wait_for(id, Duration::from_secs(40), |r| {
        matches!(
            r.status.as_str(),
            "completed" | "failed" | "parked" | "dead"
        )
    })
    .await
}

/// Waits (polling the accounting system: it gives no other signal) until
/// it holds `n` invoices.
async fn booked(sim: &str, n: usize) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while invoices(sim).await.len() < n {
        assert!(tokio::time::Instant::now() < deadline, "never booked {n}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn steps(events: &[leasehold_proto::JobEvent]) -> Vec<String> {
    events
        .iter()
        .filter(|e| e.r#type == "step")
        .map(|e| e.data_map()["id"].as_str().unwrap().to_string())
        .collect()
}

#[tokio::test]
async fn an_invoice_job_books_one_invoice_through_durable_steps() {
    let env = env().await;
    let (_sim, sim) = spawn_sim(&[]).await;
    let _w = worker(&env, &sim, &[]);
    submit(&env, "inv-1", json!({})).await;
    let rec = ended(&env, "inv-1").await;
    assert_eq!(rec.status, "completed", "{rec:?}");
    let out: Value = serde_json::from_str(&rec.result.unwrap().output).unwrap();
    assert_eq!(out["invoice"]["number"], "F-17");
    assert_eq!(out["invoice"]["supplier_id"], "sup-acme");
    assert_eq!(invoices(&sim).await.len(), 1);
    assert_eq!(
        steps(&env.events_of("inv-1").await),
        [
            "parse#0",
            "tool:lookup_supplier#0",
            "tool:create_invoice#0",
            "note#0"
        ]
    );
}

#[tokio::test]
async fn a_worker_killed_right_after_the_commit_leaves_one_invoice() {
    let env = env().await;
    let (_sim, sim) = spawn_sim(&[("LH_SIM_EFFECTS_HANG", "30s".into())]).await;
    arm(&sim, "commit_then_timeout", 1).await;
    let mut a = worker(&env, &sim, &[]);
    submit(&env, "inv-kill", json!({})).await;
    // The accounting system committed; the worker has not heard back.
    booked(&sim, 1).await;
    a.kill9();
    let _b = worker(&env, &sim, &[]);
    let rec = ended(&env, "inv-kill").await;
    assert_eq!(rec.status, "completed", "{rec:?}");
    assert!(rec.epoch >= 2, "reclaimed after the kill");
    assert_eq!(invoices(&sim).await.len(), 1, "exactly one invoice");
    // The steps before the kill were not run again: each is recorded once.
    let s = steps(&env.events_of("inv-kill").await);
    assert_eq!(s.iter().filter(|x| *x == "parse#0").count(), 1, "{s:?}");
    assert_eq!(
        s.iter().filter(|x| *x == "tool:create_invoice#0").count(),
        1,
        "{s:?}"
    );
    let reconciled = env
        .events_of("inv-kill")
        .await
        .into_iter()
        .filter(|e| e.r#type == "tool")
        .any(|e| e.data.contains("reconcil"));
    assert!(
        reconciled,
        "the second worker found the invoice before anything else"
    );
}

#[tokio::test]
async fn a_timeout_after_the_commit_is_reconciled_not_repeated() {
    let env = env().await;
    // The tool gives up after 3 s; the accounting system answers after 5.
    let (_sim, sim) = spawn_sim(&[("LH_SIM_EFFECTS_HANG", "5s".into())]).await;
    arm(&sim, "commit_then_timeout", 1).await;
    let _w = worker(&env, &sim, &[]);
    submit(&env, "inv-timeout", json!({})).await;
    let rec = ended(&env, "inv-timeout").await;
    assert_eq!(rec.status, "completed", "{rec:?}");
    assert_eq!(invoices(&sim).await.len(), 1);
}

#[tokio::test]
async fn the_same_invoice_asked_for_again_steps_later_is_the_first_one() {
    let env = env().await;
    let (_sim, sim) = spawn_sim(&[]).await;
    let _w = worker(&env, &sim, &[]);
    submit(&env, "inv-again", json!({"ask_again": true})).await;
    let rec = ended(&env, "inv-again").await;
    assert_eq!(rec.status, "completed", "{rec:?}");
    let out: Value = serde_json::from_str(&rec.result.unwrap().output).unwrap();
    assert_eq!(
        out["again"], out["invoice"],
        "the business key's first result"
    );
    assert_eq!(invoices(&sim).await.len(), 1);
    // A second job for the same invoice: the same answer, nothing booked.
    submit(&env, "inv-again-2", json!({})).await;
    let rec = ended(&env, "inv-again-2").await;
    assert_eq!(rec.status, "completed", "{rec:?}");
    assert_eq!(invoices(&sim).await.len(), 1);
}

#[tokio::test]
async fn the_same_step_with_other_arguments_after_a_code_change_is_refused_and_parked() {
    let env = env().await;
    let (_sim, sim) = spawn_sim(&[("LH_SIM_EFFECTS_HANG", "30s".into())]).await;
    arm(&sim, "commit_then_timeout", 1).await;
    let mut a = worker(&env, &sim, &[]);
    submit(&env, "inv-args", json!({})).await;
    booked(&sim, 1).await;
    a.kill9();
    // The new code books other amounts under the same step.
    let _b = worker(&env, &sim, &[("INVOICE_AMOUNT_BIAS", "1")]);
    let rec = ended(&env, "inv-args").await;
    assert_eq!(rec.status, "parked", "{rec:?}");
    assert_eq!(rec.parked_reason.as_deref(), Some("key_reuse"), "{rec:?}");
    assert_eq!(invoices(&sim).await.len(), 1);
}

#[tokio::test]
async fn an_unknowable_outcome_parks_and_a_person_resumes_it_to_one_invoice() {
    let env = env().await;
    let (_sim, sim) = spawn_sim(&[("LH_SIM_EFFECTS_HANG", "5s".into())]).await;
    arm(&sim, "commit_then_timeout", 1).await;
    arm(&sim, "lookup_ambiguous", 1).await;
    let _w = worker(&env, &sim, &[]);
    submit(&env, "inv-unknown", json!({})).await;
    let rec = ended(&env, "inv-unknown").await;
    assert_eq!(rec.status, "parked", "{rec:?}");
    assert_eq!(invoices(&sim).await.len(), 1);
    let (code, _, err) = cli(&env.url(), &["review", "resume", "inv-unknown"]).await;
    assert_eq!(code, 0, "{err}");
    let rec = env
        .wait_for("inv-unknown", Duration::from_secs(30), |r| {
            r.status == "completed"
        })
        .await;
    assert_eq!(rec.status, "completed");
    assert_eq!(invoices(&sim).await.len(), 1, "found, not booked again");
}

#[tokio::test]
async fn a_persons_answer_comes_back_to_the_step_that_asked() {
    let env = env().await;
    let (_sim, sim) = spawn_sim(&[]).await;
    let _w = worker(&env, &sim, &[]);
    submit(&env, "inv-approve", json!({"approval_over": 1000})).await;
    let rec = ended(&env, "inv-approve").await;
    assert_eq!(rec.status, "parked", "{rec:?}");
    assert_eq!(rec.parked_reason.as_deref(), Some("approval"));
    assert!(
        invoices(&sim).await.is_empty(),
        "nothing booked before the answer"
    );
    let (code, _, err) = cli(
        &env.url(),
        &["review", "resume", "inv-approve", "--answer", "not json"],
    )
    .await;
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("not JSON"), "{err}");
    let (code, _, err) = cli(
        &env.url(),
        &[
            "review",
            "resume",
            "inv-approve",
            "--answer",
            r#"{"approve": true}"#,
        ],
    )
    .await;
    assert_eq!(code, 0, "{err}");
    let rec = env
        .wait_for("inv-approve", Duration::from_secs(30), |r| {
            r.status == "completed"
        })
        .await;
    assert_eq!(rec.status, "completed");
    assert_eq!(invoices(&sim).await.len(), 1);
    // The answer is a recorded step: the park is not asked again.
    let s = steps(&env.events_of("inv-approve").await);
    assert_eq!(s.iter().filter(|x| *x == "park#0").count(), 1, "{s:?}");
    // It came as a signal from a person, naming the park it answered.
    let answers = leasehold_testkit::doors::signals::Signals::new(&env.conn)
        .all("inv-approve", "lh-answer")
        .await
        .unwrap();
    assert_eq!(answers.len(), 1, "{answers:?}");
    assert_eq!(answers[0].data["step"], json!("park#0"));
    assert_eq!(answers[0].data["answer"], json!({"approve": true}));
    assert!(
        answers[0]
            .sender
            .as_deref()
            .unwrap_or("")
            .ends_with(" via cli"),
        "{answers:?}"
    );
}

#[tokio::test]
async fn a_worker_paused_past_its_session_during_the_effect_neither_books_nor_records_again() {
    let env = env().await;
    let (_sim, sim) = spawn_sim(&[("LH_SIM_EFFECTS_HANG", "6s".into())]).await;
    arm(&sim, "commit_then_timeout", 1).await;
    let a = worker(&env, &sim, &[]);
    submit(&env, "inv-stop", json!({})).await;
    booked(&sim, 1).await;
    a.stop();
    let _b = worker(&env, &sim, &[]);
    let rec = env
        .wait_for("inv-stop", Duration::from_secs(40), |r| {
            r.status == "completed"
        })
        .await;
    assert!(rec.epoch >= 2);
    a.cont();
    // The paused owner wakes, finds its session gone, and re-checks its job.
    wait_log(
        &a,
        "re-offered while this process was away",
        Duration::from_secs(20),
    )
    .await;
    assert_eq!(invoices(&sim).await.len(), 1);
    let s = steps(&env.events_of("inv-stop").await);
    assert_eq!(
        s.iter().filter(|x| *x == "tool:create_invoice#0").count(),
        1,
        "the stale owner's record was refused: {s:?}"
    );
    let after = env.jobs.get("inv-stop").await.unwrap().unwrap();
    assert_eq!(after.value.status, "completed");
    assert_eq!(after.value.epoch, rec.epoch, "no stale write");
}
