//! Remote kinds: kinds served by an HTTP service through the worker
//! protocol (docs/protocol.md), against real processes: `leasehold-worker`
//! with `--remote-kind`, the Python SDK serving the Python invoice agent
//! (`examples/invoice-python`), the TypeScript SDK serving the TypeScript
//! one (`examples/invoice-typescript`), the accounting system of
//! `leasehold-sim`, and a service that breaks the protocol on purpose
//! (`tests/remote/bad_service.py`).
//!
//! The conformance suite (`conformance_*`), the invoice agent's scenarios,
//! signing and `generate` run once per SDK (`both_sdks!`): under their own
//! names against the service of `LH_REMOTE_SERVICE` (a shell command
//! serving the `conformance` kind on `$LEASEHOLD_PORT` and printing
//! `listening on http://ADDR`; by default the Python SDK's), and in
//! `typescript::` against the TypeScript SDK (`LH_TYPESCRIPT_SDK`: the npm
//! prefix `make typescript-sdk` installed it into, else the checkout's).
//! Any SDK passes the suite to claim conformance.

use std::path::PathBuf;
use std::time::Duration;

use leasehold::JobRecord;
use leasehold_harness::{free_port, Proc};
use leasehold_proto::JobEvent;
use leasehold_testkit::SetupOptions;
use serde_json::{json, Value};

use leasehold_testkit::*;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn python() -> String {
    std::env::var("LH_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// The SDK whose service a test drives. Every test of the invoice agent,
/// of the conformance suite, of signing and of `generate` runs once per
/// SDK (`both_sdks!`): the Python one under its own name, the TypeScript
/// one in `mod typescript`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Sdk {
    /// The Python SDK serving `examples/invoice-python/app.py`, or the
    /// command `LH_REMOTE_SERVICE` names (another SDK's).
    Python,
    /// The TypeScript SDK serving `examples/invoice-typescript/app.js`.
    TypeScript,
}

/// `node` (LH_NODE, else the one on PATH).
fn node() -> String {
    std::env::var("LH_NODE").unwrap_or_else(|_| "node".into())
}

/// The shell command serving the invoice agent (and the `conformance`
/// kind) with `sdk`, on `$LEASEHOLD_PORT`.
fn service_command(sdk: Sdk) -> String {
    let root = repo();
    match sdk {
        Sdk::Python => std::env::var("LH_REMOTE_SERVICE")
            .unwrap_or_else(|_| format!("exec {} -m leasehold serve app:app", python())),
        Sdk::TypeScript => {
            let app = root.join("examples/invoice-typescript/app.js");
            // The package `make typescript-sdk` installed with npm (its
            // `leasehold` command, what `npx leasehold` runs), else the
            // checkout's (no build step: the package is its sources).
            match std::env::var_os("LH_TYPESCRIPT_SDK") {
                Some(prefix) => format!(
                    "exec {} serve {}",
                    PathBuf::from(prefix)
                        .join("node_modules/.bin/leasehold")
                        .display(),
                    app.display()
                ),
                None => format!(
                    "exec {} {} serve {}",
                    node(),
                    root.join("sdks/typescript/bin/leasehold.js").display(),
                    app.display()
                ),
            }
        }
    }
}

/// `sdk`'s service on `port`, the accounting system at `sim`.
async fn service(sdk: Sdk, port: u16, sim: &str, extra: &[(&'static str, &str)]) -> Proc {
    let root = repo();
    let mut e: Vec<(&str, String)> = vec![
        ("LEASEHOLD_PORT", port.to_string()),
        // The installed SDK with LH_PYTHON (make python-sdk), else the
        // checkout's.
        (
            "PYTHONPATH",
            if std::env::var_os("LH_PYTHON").is_some() {
                root.join("examples/invoice-python").display().to_string()
            } else {
                format!(
                    "{}:{}",
                    root.join("sdks/python/src").display(),
                    root.join("examples/invoice-python").display()
                )
            },
        ),
        ("INVOICE_ACCOUNTING_URL", sim.to_string()),
        ("PYTHONUNBUFFERED", "1".into()),
    ];
    e.extend(extra.iter().map(|(k, v)| (*k, v.to_string())));
    let cmd = service_command(sdk);
    let p = Proc::spawn_path(std::path::Path::new("/bin/sh"), &["-c", &cmd], &e, None);
    wait_log(&p, "listening on ", Duration::from_secs(15)).await;
    p
}

/// The Python SDK serving `tests/remote/doors_service.py` (kinds `append`
/// and `gates`) on `port`.
async fn doors_service(port: u16, extra: &[(&'static str, String)]) -> Proc {
    let root = repo();
    let mut path = root.join("tests/remote").display().to_string();
    if std::env::var_os("LH_PYTHON").is_none() {
        path = format!("{path}:{}", root.join("sdks/python/src").display());
    }
    let mut e: Vec<(&str, String)> = vec![
        ("LEASEHOLD_PORT", port.to_string()),
        ("PYTHONPATH", path),
        ("PYTHONUNBUFFERED", "1".into()),
    ];
    e.extend(extra.iter().cloned());
    let p = Proc::spawn_path(
        std::path::Path::new(&python()),
        &["-m", "leasehold", "serve", "doors_service:app"],
        &e,
        None,
    );
    wait_log(&p, "listening on ", Duration::from_secs(15)).await;
    p
}

/// The protocol-breaking service.
async fn bad_service() -> (Proc, String) {
    let port = free_port();
    let script = repo().join("tests/remote/bad_service.py");
    let p = Proc::spawn_path(
        std::path::Path::new(&python()),
        &[script.to_str().unwrap()],
        &[("LEASEHOLD_PORT", port.to_string())],
        None,
    );
    wait_log(&p, "listening on ", Duration::from_secs(15)).await;
    (p, format!("http://127.0.0.1:{port}"))
}

async fn env() -> Fleet {
    let mut o = SetupOptions {
        ack_wait: ACK_WAIT,
        ..SetupOptions::default()
    };
    o.kinds.extend(
        [
            "invoice",
            "conformance",
            "bad",
            "append",
            "gates",
            "bka",
            "bkb",
            "echo-remote",
        ]
        .map(String::from),
    );
    Fleet::with(o).await
}

/// A `leasehold-worker` serving `echo` and the remote kinds `remote`
/// (`NAME=URL,...`).
fn worker(env: &Fleet, remote: &str, extra: &[(&'static str, &str)]) -> Proc {
    let mut e: Vec<(&'static str, String)> = vec![
        ("LH_KINDS", "echo".into()),
        ("LH_REMOTE_KINDS", remote.to_string()),
        ("LH_RETRY_BASE", "100ms".into()),
        ("LH_RETRY_CAP", "400ms".into()),
    ];
    e.extend(extra.iter().map(|(k, v)| (*k, v.to_string())));
    env.worker_proc(&[], &e)
}

fn url(port: u16) -> String {
    format!("http://127.0.0.1:{port}/")
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

async fn booked(sim: &str, n: usize) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while invoices(sim).await.len() < n {
        assert!(tokio::time::Instant::now() < deadline, "never booked {n}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn submit_invoice(env: &Fleet, id: &str, extra: Value) {
    let mut input = json!({"email": {"from": "billing@acme.example", "body": "Hello,\nInvoice F-17 from ACME: 1,200.00 EUR, due in 30 days."}});
    if let (Some(i), Some(e)) = (input.as_object_mut(), extra.as_object()) {
        i.extend(e.clone());
    }
    env.submit("invoice", json!({"input": input}), id).await;
}

async fn ended(env: &Fleet, id: &str) -> JobRecord {
    env.wait_for(id, Duration::from_secs(45), |r| {
        matches!(
            r.status.as_str(),
            "completed" | "failed" | "parked" | "dead"
        )
    })
    .await
}

fn steps(events: &[JobEvent]) -> Vec<String> {
    events
        .iter()
        .filter(|e| e.r#type == "step")
        .map(|e| e.data_map()["id"].as_str().unwrap().to_string())
        .collect()
}

fn count(s: &[String], id: &str) -> usize {
    s.iter().filter(|x| *x == id).count()
}

fn output(rec: &JobRecord) -> Value {
    serde_json::from_str(&rec.result.as_ref().expect("a result").output).unwrap()
}

// ---- the invoice agent in Python ------------------------------------------

async fn invoice_books_one_invoice_through_durable_steps(sdk: Sdk) {
    let env = env().await;
    let (_sim, sim) = spawn_sim(&[]).await;
    let port = free_port();
    let _s = service(sdk, port, &sim, &[]).await;
    let _w = worker(&env, &format!("invoice={}", url(port)), &[]);
    submit_invoice(&env, "rinv-1", json!({})).await;
    let rec = ended(&env, "rinv-1").await;
    assert_eq!(rec.status, "completed", "{rec:?}");
    let out = output(&rec);
    assert_eq!(out["invoice"]["number"], "F-17");
    assert_eq!(out["invoice"]["supplier_id"], "sup-acme");
    assert_eq!(invoices(&sim).await.len(), 1);
    assert_eq!(
        steps(&env.events_of("rinv-1").await),
        [
            "parse#0",
            "lookup_supplier#0",
            "effect:create_invoice#0",
            "note#0"
        ]
    );
}

async fn worker_killed_right_after_the_commit_leaves_one_invoice(sdk: Sdk) {
    let env = env().await;
    let (_sim, sim) = spawn_sim(&[("LH_SIM_EFFECTS_HANG", "30s".into())]).await;
    arm(&sim, "commit_then_timeout", 1).await;
    let port = free_port();
    let _s = service(sdk, port, &sim, &[]).await;
    let remote = format!("invoice={}", url(port));
    let mut a = worker(&env, &remote, &[]);
    submit_invoice(&env, "rinv-kill", json!({})).await;
    booked(&sim, 1).await;
    a.kill9();
    let _b = worker(&env, &remote, &[]);
    let rec = ended(&env, "rinv-kill").await;
    assert_eq!(rec.status, "completed", "{rec:?}");
    assert!(rec.epoch >= 2, "reclaimed after the kill");
    assert_eq!(invoices(&sim).await.len(), 1, "exactly one invoice");
    let events = env.events_of("rinv-kill").await;
    let s = steps(&events);
    assert_eq!(count(&s, "parse#0"), 1, "{s:?}");
    assert_eq!(count(&s, "effect:create_invoice#0"), 1, "{s:?}");
    assert!(
        events
            .iter()
            .any(|e| e.r#type == "tool" && e.data.contains("reconcil")),
        "the second worker asked the service's find_existing first"
    );
}

async fn service_killed_mid_step_is_called_again_and_books_one_invoice(sdk: Sdk) {
    let env = env().await;
    let (_sim, sim) = spawn_sim(&[]).await;
    let port = free_port();
    let mut s = service(sdk, port, &sim, &[]).await;
    // Each attempt while the service is down ends after its connection
    // retries (about 3 s): on a loaded machine a Python service can take
    // longer to come back than five of them. This test is about the step
    // called again and the one invoice, not the retry budget.
    let _w = worker(
        &env,
        &format!("invoice={}", url(port)),
        &[("LH_MAX_ATTEMPTS", "20")],
    );
    // The first parse is slow; the service dies in it.
    submit_invoice(&env, "rinv-svc", json!({"slow_parse_s": 30})).await;
    wait_log(&s, "parsing rinv-svc", Duration::from_secs(20)).await;
    s.kill9();
    // The next attempt (epoch 2: the hook is slow in epoch 1 only) runs
    // the parse again, since its record never landed.
    let _s2 = service(sdk, port, &sim, &[]).await;
    let rec = ended(&env, "rinv-svc").await;
    assert_eq!(rec.status, "completed", "{rec:?}");
    let booked = invoices(&sim).await;
    assert_eq!(booked.len(), 1, "{booked:?}");
    let s = steps(&env.events_of("rinv-svc").await);
    assert_eq!(count(&s, "parse#0"), 1, "recorded once: {s:?}");
}

async fn timeout_after_the_commit_is_reconciled_not_repeated(sdk: Sdk) {
    let env = env().await;
    // The effect's timeout is 3 s; the accounting system answers after 5.
    let (_sim, sim) = spawn_sim(&[("LH_SIM_EFFECTS_HANG", "5s".into())]).await;
    arm(&sim, "commit_then_timeout", 1).await;
    let port = free_port();
    let _s = service(sdk, port, &sim, &[]).await;
    let _w = worker(&env, &format!("invoice={}", url(port)), &[]);
    submit_invoice(&env, "rinv-timeout", json!({})).await;
    let rec = ended(&env, "rinv-timeout").await;
    assert_eq!(rec.status, "completed", "{rec:?}");
    assert_eq!(invoices(&sim).await.len(), 1, "exactly one invoice");
}

async fn the_same_invoice_asked_for_again_is_the_first_one(sdk: Sdk) {
    let env = env().await;
    let (_sim, sim) = spawn_sim(&[]).await;
    let port = free_port();
    let _s = service(sdk, port, &sim, &[]).await;
    let _w = worker(&env, &format!("invoice={}", url(port)), &[]);
    submit_invoice(&env, "rinv-again", json!({"ask_again": true})).await;
    let rec = ended(&env, "rinv-again").await;
    assert_eq!(rec.status, "completed", "{rec:?}");
    let out = output(&rec);
    assert_eq!(
        out["again"], out["invoice"],
        "the business key's first result"
    );
    // A second job for the same invoice (a duplicate request): nothing booked.
    submit_invoice(&env, "rinv-again-2", json!({})).await;
    let rec = ended(&env, "rinv-again-2").await;
    assert_eq!(rec.status, "completed", "{rec:?}");
    assert_eq!(invoices(&sim).await.len(), 1, "exactly one invoice");
}

async fn a_persons_answer_comes_back_to_the_park_that_asked(sdk: Sdk) {
    let env = env().await;
    let (_sim, sim) = spawn_sim(&[]).await;
    let port = free_port();
    let _s = service(sdk, port, &sim, &[]).await;
    let _w = worker(&env, &format!("invoice={}", url(port)), &[]);
    submit_invoice(&env, "rinv-approve", json!({"approval_over": 1000})).await;
    let rec = ended(&env, "rinv-approve").await;
    assert_eq!(rec.status, "parked", "{rec:?}");
    assert_eq!(rec.parked_reason.as_deref(), Some("approval"));
    assert!(invoices(&sim).await.is_empty(), "nothing before the answer");
    let (code, _, err) = cli(
        &env.url(),
        &[
            "review",
            "resume",
            "rinv-approve",
            "--answer",
            r#"{"approve": true}"#,
        ],
    )
    .await;
    assert_eq!(code, 0, "{err}");
    let rec = env
        .wait_for("rinv-approve", Duration::from_secs(30), |r| {
            r.status == "completed"
        })
        .await;
    assert_eq!(rec.status, "completed");
    assert_eq!(invoices(&sim).await.len(), 1);
    let s = steps(&env.events_of("rinv-approve").await);
    assert_eq!(count(&s, "park#0"), 1, "the answer is recorded once: {s:?}");
}

// ---- bad answers ----------------------------------------------------------

/// A `bad` job against the protocol-breaking service: how it ends. Two
/// attempts at most; the worker serves an echo job afterwards.
async fn bad(mode: &str) -> (JobRecord, Vec<JobEvent>) {
    let env = env().await;
    let (_b, base) = bad_service().await;
    let _w = worker(
        &env,
        &format!("bad={base}/"),
        &[("LH_MAX_ATTEMPTS", "2"), ("LH_REMOTE_MAX_BODY", "65536")],
    );
    let id = format!("bad-{}", mode.replace('_', "-"));
    env.submit("bad", json!({"input": {"bad": mode}}), &id)
        .await;
    let rec = ended(&env, &id).await;
    // The worker is unaffected: it runs the next job.
    env.submit("echo", json!({"input": {"after": mode}}), "echo-after")
        .await;
    let echo = env
        .wait_status("echo-after", "completed", Duration::from_secs(20))
        .await;
    assert_eq!(echo.status, "completed");
    let events = env.events_of(&id).await;
    (rec, events)
}

fn error_of(rec: &JobRecord) -> String {
    rec.error
        .as_ref()
        .map(|e| e.message.clone())
        .unwrap_or_default()
}

#[tokio::test]
async fn remote_bad_answer_not_json_is_retried_then_fails_with_a_clear_error() {
    let (rec, _) = bad("not_json").await;
    assert_eq!(rec.status, "failed", "{rec:?}");
    let m = error_of(&rec);
    assert!(
        m.contains("protocol_error") && m.contains("not_json"),
        "{m}"
    );
    assert_eq!(rec.attempts, 2, "retried before failing: {rec:?}");
}

#[tokio::test]
async fn remote_bad_answer_wrong_schema_fails_with_a_clear_error() {
    let (rec, events) = bad("wrong_schema").await;
    assert_eq!(rec.status, "failed", "{rec:?}");
    let m = error_of(&rec);
    assert!(m.contains("bad_answer") && m.contains("index"), "{m}");
    assert!(steps(&events).is_empty(), "nothing recorded: {events:?}");
}

#[tokio::test]
async fn remote_bad_answer_unknown_op_fails_with_a_clear_error() {
    let (rec, _) = bad("unknown_op").await;
    assert_eq!(rec.status, "failed", "{rec:?}");
    let m = error_of(&rec);
    assert!(m.contains("unknown_op") && m.contains("teleport"), "{m}");
}

#[tokio::test]
async fn remote_bad_answer_a_step_recorded_twice_with_another_result_parks() {
    let (rec, events) = bad("step_conflict").await;
    assert_eq!(rec.status, "parked", "{rec:?}");
    assert_eq!(rec.parked_reason.as_deref(), Some("protocol_error"));
    let s = steps(&events);
    assert_eq!(s, ["a#0"], "the first record stands, alone: {s:?}");
    let first = events.iter().find(|e| e.r#type == "step").unwrap();
    assert_eq!(first.data_map()["result"], json!(1));
}

#[tokio::test]
async fn remote_bad_answer_over_the_body_limit_fails_with_a_clear_error() {
    let (rec, _) = bad("too_large").await;
    assert_eq!(rec.status, "failed", "{rec:?}");
    let m = error_of(&rec);
    assert!(m.contains("answer_too_large"), "{m}");
}

/// G16: a step whose journal entry could never be sent back with its job
/// (over the body limit) is not recorded: the job parks at once with the
/// reason, instead of failing every later call with `request_too_large`.
#[tokio::test]
async fn remote_a_step_too_large_to_send_back_parks_and_is_not_recorded() {
    let (rec, events) = bad("big_step").await;
    assert_eq!(rec.status, "parked", "{rec:?}");
    assert_eq!(rec.parked_reason.as_deref(), Some("protocol_error"));
    let m = error_of(&rec);
    assert!(m.contains("step_too_large") && m.contains("`a#0`"), "{m}");
    assert!(steps(&events).is_empty(), "nothing recorded: {events:?}");
}

#[tokio::test]
async fn remote_an_unknown_protocol_version_fails_at_once_with_a_clear_error() {
    let (rec, _) = bad("v2_only").await;
    assert_eq!(rec.status, "failed", "{rec:?}");
    assert_eq!(rec.attempts, 1, "not retried: {rec:?}");
    let m = error_of(&rec);
    assert!(m.contains("unsupported_protocol"), "{m}");
}

// ---- the conformance suite ------------------------------------------------

async fn conformance_env(sdk: Sdk) -> (Fleet, Proc, u16, String) {
    let env = env().await;
    let port = free_port();
    let s = service(sdk, port, "http://127.0.0.1:9", &[]).await;
    let remote = format!("conformance={}", url(port));
    (env, s, port, remote)
}

async fn submit_conf(env: &Fleet, id: &str, input: Value) {
    env.submit("conformance", json!({"input": input}), id).await;
}

async fn conformance_kill_9_of_the_worker_mid_step_resumes_from_the_journal(sdk: Sdk) {
    let (env, s, _port, remote) = conformance_env(sdk).await;
    let mut a = worker(&env, &remote, &[]);
    submit_conf(
        &env,
        "conf-wkill",
        json!({"steps": 3, "slow_step": 1, "slow_s": 30, "slow_epoch": 1}),
    )
    .await;
    wait_log(&s, "step 1 of conf-wkill epoch 1", Duration::from_secs(20)).await;
    a.kill9();
    let _b = worker(&env, &remote, &[]);
    let rec = ended(&env, "conf-wkill").await;
    assert_eq!(rec.status, "completed", "{rec:?}");
    assert_eq!(output(&rec)["sum"], 3);
    let st = steps(&env.events_of("conf-wkill").await);
    assert_eq!(st, ["count#0", "count#1", "count#2"], "each once: {st:?}");
}

async fn conformance_kill_9_of_the_service_mid_step_and_after_its_answer(sdk: Sdk) {
    let (env, mut s, port, remote) = conformance_env(sdk).await;
    let _w = worker(&env, &remote, &[]);
    submit_conf(
        &env,
        "conf-skill",
        json!({"steps": 3, "slow_step": 1, "slow_s": 30, "slow_epoch": 1}),
    )
    .await;
    // Step 0 was answered (and recorded); the service dies in step 1.
    wait_log(&s, "step 1 of conf-skill epoch 1", Duration::from_secs(20)).await;
    s.kill9();
    let _s2 = service(sdk, port, "http://127.0.0.1:9", &[]).await;
    let rec = ended(&env, "conf-skill").await;
    assert_eq!(rec.status, "completed", "{rec:?}");
    let st = steps(&env.events_of("conf-skill").await);
    assert_eq!(st, ["count#0", "count#1", "count#2"], "each once: {st:?}");
}

async fn conformance_a_duplicate_call_gets_the_same_answer_and_records_nothing(sdk: Sdk) {
    let (env, _s, port, remote) = conformance_env(sdk).await;
    let _w = worker(&env, &remote, &[]);
    submit_conf(&env, "conf-dup", json!({"steps": 2})).await;
    let rec = ended(&env, "conf-dup").await;
    assert_eq!(rec.status, "completed", "{rec:?}");
    // The same call delivered twice (a retry of a lost answer): the same
    // answer both times, and the worker's journal is unchanged.
    let call = json!({
        "protocol": 1, "type": "invoke",
        "job": {"id": "conf-dup", "kind": "conformance", "input": {"steps": 2}, "epoch": rec.epoch, "attempt": 1, "deadline": null},
        "journal": {"from": 0, "total": 1, "entries": [{"index": 0, "id": "count#0", "result": {"i": 0}}], "next_cursor": null}
    });
    let http = reqwest::Client::new();
    let mut answers = Vec::new();
    for _ in 0..2 {
        let v: Value = http
            .post(format!("http://127.0.0.1:{port}/invoke"))
            .json(&call)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        answers.push(v);
    }
    assert_eq!(answers[0], answers[1]);
    assert_eq!(answers[0]["op"], "step");
    assert_eq!(answers[0]["id"], "count#1");
    let st = steps(&env.events_of("conf-dup").await);
    assert_eq!(st, ["count#0", "count#1"], "{st:?}");
}

async fn conformance_a_stale_epochs_late_answer_writes_nothing(sdk: Sdk) {
    let (env, s, _port, remote) = conformance_env(sdk).await;
    let a = worker(&env, &remote, &[]);
    submit_conf(
        &env,
        "conf-stale",
        json!({"steps": 3, "slow_step": 1, "slow_s": 4, "slow_epoch": 1}),
    )
    .await;
    wait_log(&s, "step 1 of conf-stale epoch 1", Duration::from_secs(20)).await;
    // The owner pauses past its session while the service works for it.
    a.stop();
    let _b = worker(&env, &remote, &[]);
    let rec = env
        .wait_for("conf-stale", Duration::from_secs(40), |r| {
            r.status == "completed"
        })
        .await;
    assert!(rec.epoch >= 2);
    // The stale owner wakes with the service's answer for epoch 1.
    a.cont();
    wait_log(
        &a,
        "re-offered while this process was away",
        Duration::from_secs(20),
    )
    .await;
    let events = env.events_of("conf-stale").await;
    let st = steps(&events);
    assert_eq!(
        count(&st, "count#1"),
        1,
        "the late answer was not recorded: {st:?}"
    );
    assert!(
        events
            .iter()
            .filter(|e| e.r#type == "step" && e.data_map()["id"] == "count#1")
            .all(|e| e.epoch >= 2),
        "step 1 is of the new owner"
    );
    let after = env.jobs.get("conf-stale").await.unwrap().unwrap();
    assert_eq!(after.value.status, "completed");
    assert_eq!(after.value.epoch, rec.epoch, "no stale write");
}

async fn conformance_a_journal_mismatch_after_a_code_change_parks_with_both_steps(sdk: Sdk) {
    let (env, mut s, port, remote) = conformance_env(sdk).await;
    let mut a = worker(&env, &remote, &[]);
    submit_conf(
        &env,
        "conf-mismatch",
        json!({"steps": 3, "slow_step": 2, "slow_s": 30, "slow_epoch": 1}),
    )
    .await;
    wait_log(
        &s,
        "step 2 of conf-mismatch epoch 1",
        Duration::from_secs(20),
    )
    .await;
    a.kill9();
    s.kill9();
    // New code: step 1 is now named `tally`.
    let _s2 = service(
        sdk,
        port,
        "http://127.0.0.1:9",
        &[("CONFORMANCE_CODE_VERSION", "2")],
    )
    .await;
    let _b = worker(&env, &remote, &[]);
    let rec = ended(&env, "conf-mismatch").await;
    assert_eq!(rec.status, "parked", "{rec:?}");
    assert_eq!(rec.parked_reason.as_deref(), Some("journal_mismatch"));
    let m = error_of(&rec);
    let events = env.events_of("conf-mismatch").await;
    let parked = events
        .iter()
        .rev()
        .find(|e| e.r#type == "parked")
        .map(|e| e.data.clone())
        .unwrap_or_default();
    let text = format!("{m} {parked}");
    assert!(
        text.contains("count#1") && text.contains("tally#0"),
        "both steps named: {text}"
    );
    assert_eq!(steps(&events), ["count#0", "count#1"], "nothing guessed");
}

async fn conformance_a_slow_service_past_the_call_deadline_is_retried(sdk: Sdk) {
    let (env, _s, _port, remote) = conformance_env(sdk).await;
    let _w = worker(&env, &remote, &[("LH_REMOTE_TIMEOUT", "1500ms")]);
    submit_conf(
        &env,
        "conf-slow",
        json!({"steps": 2, "slow_step": 0, "slow_s": 5, "slow_epoch": 1}),
    )
    .await;
    let rec = ended(&env, "conf-slow").await;
    assert_eq!(rec.status, "completed", "{rec:?}");
    assert!(rec.epoch >= 2, "a later attempt finished it: {rec:?}");
    let st = steps(&env.events_of("conf-slow").await);
    assert_eq!(st, ["count#0", "count#1"], "{st:?}");
}

async fn conformance_a_malformed_call_gets_a_clear_error_and_the_service_lives(sdk: Sdk) {
    let (_env, mut s, port, _remote) = conformance_env(sdk).await;
    let http = reqwest::Client::new();
    let base = format!("http://127.0.0.1:{port}");
    let r = http
        .post(format!("{base}/invoke"))
        .header("content-type", "application/json")
        .body("not json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "bad_request", "{v}");
    let r = http
        .post(format!("{base}/invoke"))
        .json(&json!({"protocol": 99, "type": "invoke"}))
        .send()
        .await
        .unwrap();
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "unsupported_protocol", "{v}");
    assert_eq!(v["error"]["supported"], json!([1]), "{v}");
    assert!(s.alive(), "the service lives");
}

async fn conformance_an_oversized_journal_is_paged(sdk: Sdk) {
    let (env, s, _port, remote) = conformance_env(sdk).await;
    // 40 steps of 2 KB each, pages of 8 entries and 16 KB bodies: the
    // journal never fits one call.
    let small: &[(&'static str, &str)] = &[
        ("LH_REMOTE_JOURNAL_PAGE", "8"),
        ("LH_REMOTE_MAX_BODY", "16384"),
    ];
    let mut a = worker(&env, &remote, small);
    submit_conf(
        &env,
        "conf-big",
        json!({"steps": 40, "pad": 2000, "slow_step": 39, "slow_s": 30, "slow_epoch": 1}),
    )
    .await;
    wait_log(&s, "step 39 of conf-big epoch 1", Duration::from_secs(40)).await;
    // The next owner replays 39 recorded steps of 2 KB through pages.
    a.kill9();
    let b = worker(&env, &remote, small);
    let rec = ended(&env, "conf-big").await;
    assert_eq!(rec.status, "completed", "{rec:?}");
    assert_eq!(output(&rec)["sum"], (0..40).sum::<u64>());
    assert!(rec.epoch >= 2, "{rec:?}");
    let st = steps(&env.events_of("conf-big").await);
    assert_eq!(st.len(), 40, "each step recorded once");
    // The new owner sent the 39 recorded steps in pages the service asked for.
    let pages = b
        .output()
        .matches("the service asked for the journal from")
        .count();
    assert!(pages >= 4, "paged: {pages} pages asked for\n{}", b.output());
}

/// A `retry` op ends the attempt at once and the job waits queued for the
/// delay it asked, holding no slot, whatever its length: an hour (beyond
/// any call or attempt deadline, and the old 30 s in-attempt cap), while
/// the worker's one slot runs a job asking for 2.5 s, which runs again
/// after that delay and completes from its journal.
async fn conformance_a_retry_waits_queued_for_its_delay_without_a_slot(sdk: Sdk) {
    let (env, _s, _port, remote) = conformance_env(sdk).await;
    let _w = worker(&env, &remote, &[("LH_CONCURRENCY", "1")]);
    submit_conf(
        &env,
        "conf-retry-long",
        json!({"steps": 1, "retry_ms": 3_600_000}),
    )
    .await;
    let rec = env
        .wait_for("conf-retry-long", Duration::from_secs(20), |r| {
            r.status == "queued" && r.attempts == 1
        })
        .await;
    let due = rec
        .next_run_at
        .as_deref()
        .and_then(leasehold_testkit::record::parse_rfc3339)
        .expect("a due time");
    let ahead = due
        .duration_since(std::time::SystemTime::now())
        .unwrap_or_default();
    assert!(
        ahead > Duration::from_secs(3500),
        "due in about an hour: {ahead:?} ({rec:?})"
    );
    // The worker's only slot is free: the next job runs now.
    let t0 = std::time::Instant::now();
    submit_conf(
        &env,
        "conf-retry-short",
        json!({"steps": 2, "retry_ms": 2500}),
    )
    .await;
    let short = ended(&env, "conf-retry-short").await;
    assert_eq!(short.status, "completed", "{short:?}");
    assert_eq!(output(&short)["sum"], 1);
    assert!(
        t0.elapsed() >= Duration::from_millis(2500),
        "the second attempt waited for the delay: {:?}",
        t0.elapsed()
    );
    assert_eq!(short.attempts, 1, "one failed attempt: {short:?}");
    let st = steps(&env.events_of("conf-retry-short").await);
    assert_eq!(
        st,
        ["count#0", "count#1"],
        "recorded once, replayed: {st:?}"
    );
    let long = env.jobs.get("conf-retry-long").await.unwrap().unwrap();
    assert_eq!(
        long.value.status, "queued",
        "still waiting: {:?}",
        long.value
    );
}

/// The `sleep` op: the job waits holding no worker (its one slot runs the
/// next job meanwhile), wakes at its time and resumes from its journal:
/// each step recorded once.
async fn conformance_a_sleep_waits_without_a_slot_and_resumes_at_its_time(sdk: Sdk) {
    let (env, _s, _port, remote) = conformance_env(sdk).await;
    let _w = worker(&env, &remote, &[("LH_CONCURRENCY", "1")]);
    submit_conf(&env, "conf-sleep", json!({"steps": 2, "sleep_ms": 3000})).await;
    let asleep = env
        .wait_status("conf-sleep", "waiting", Duration::from_secs(20))
        .await;
    assert_eq!(
        asleep.waiting_step.as_deref(),
        Some("sleep#0"),
        "{asleep:?}"
    );
    let until = asleep
        .next_run_at
        .as_deref()
        .and_then(leasehold_testkit::record::parse_rfc3339)
        .expect("a wake-up time");
    submit_conf(&env, "conf-awake", json!({"steps": 1})).await;
    let other = ended(&env, "conf-awake").await;
    assert_eq!(other.status, "completed", "{other:?}");
    assert_eq!(env.record("conf-sleep").await.unwrap().status, "waiting");
    let done = ended(&env, "conf-sleep").await;
    assert_eq!(done.status, "completed", "{done:?}");
    assert!(std::time::SystemTime::now() >= until);
    assert_eq!(output(&done)["sum"], 1);
    assert_eq!(done.attempts, 0, "a sleep spends no attempt: {done:?}");
    let st = steps(&env.events_of("conf-sleep").await);
    assert_eq!(st, ["count#0", "count#1", "sleep#0"], "each once: {st:?}");
}

async fn conformance_a_signal_wakes_a_waiting_job_and_one_sent_before_is_kept(sdk: Sdk) {
    let (env, _s, _port, remote) = conformance_env(sdk).await;
    let _w = worker(&env, &remote, &[("LH_CONCURRENCY", "1")]);
    submit_conf(
        &env,
        "conf-signal",
        json!({"steps": 1, "signal": "confirmation", "signal_timeout_ms": 600000}),
    )
    .await;
    let waiting = env
        .wait_status("conf-signal", "waiting", Duration::from_secs(20))
        .await;
    assert_eq!(
        (
            waiting.waiting_for.as_deref(),
            waiting.waiting_step.as_deref()
        ),
        (Some("signal:confirmation"), Some("wait:confirmation#0")),
        "{waiting:?}"
    );
    // Its slot is free meanwhile.
    submit_conf(&env, "conf-meanwhile", json!({"steps": 1})).await;
    assert_eq!(ended(&env, "conf-meanwhile").await.status, "completed");
    // Two signals at once: the waiting wait takes the first, the next
    // wait the second (kept for it), in the order sent.
    for n in [1, 2] {
        let (code, _, err) = cli(
            &env.url(),
            &[
                "signal",
                "conf-signal",
                "confirmation",
                "--data",
                &format!(r#"{{"n": {n}}}"#),
            ],
        )
        .await;
        assert_eq!(code, 0, "{err}");
    }
    let done = ended(&env, "conf-signal").await;
    assert_eq!(done.status, "completed", "{done:?}");
    let got = &output(&done)["signals"];
    assert_eq!(
        (&got[0]["data"], &got[1]["data"]),
        (&json!({"n": 1}), &json!({"n": 2})),
        "{got}"
    );
    assert_eq!(done.attempts, 0, "a wait spends no attempt: {done:?}");
    let st = steps(&env.events_of("conf-signal").await);
    assert_eq!(
        st,
        ["count#0", "wait:confirmation#0", "wait:confirmation#1"],
        "each once: {st:?}"
    );
}

async fn conformance_a_parent_waits_for_its_children_and_gets_every_outcome(sdk: Sdk) {
    let (env, _s, _port, remote) = conformance_env(sdk).await;
    let _w = worker(&env, &remote, &[("LH_CONCURRENCY", "1")]);
    // The children (`echo`) run on a worker of their own.
    let (echo, stop) = env.worker().await;
    submit_conf(&env, "conf-children", json!({"steps": 1, "children": 3})).await;
    let done = ended(&env, "conf-children").await;
    assert_eq!(done.status, "completed", "{done:?}");
    let outcomes = output(&done)["children"].as_array().cloned().unwrap();
    assert_eq!(outcomes.len(), 3, "{outcomes:?}");
    for (k, o) in outcomes.iter().enumerate() {
        assert_eq!(
            (&o["status"], &o["result"]),
            (&json!("completed"), &json!({"i": k})),
            "{o}"
        );
        let child = env.record(o["id"].as_str().unwrap()).await.unwrap();
        assert_eq!(
            child.spec.unwrap().parent.unwrap().id,
            "conf-children",
            "each child names its parent"
        );
    }
    assert_eq!(done.attempts, 0, "a join spends no attempt: {done:?}");
    let evs = env.events_of("conf-children").await;
    let st = steps(&evs);
    assert_eq!(
        st,
        ["count#0", "spawn:echo#0", "join#0"],
        "each once: {st:?}"
    );
    let waits: Vec<_> = evs.iter().filter(|e| e.r#type == "waiting").collect();
    assert!(
        waits.len() <= 1 && waits.iter().all(|w| w.data_map()["for"] == "children"),
        "{waits:?}"
    );
    stop.cancel();
    echo.wait().await.unwrap();
}

async fn conformance_a_journal_check_lists_the_jobs_a_code_change_would_park(sdk: Sdk) {
    let (env, _s, port, remote) = conformance_env(sdk).await;
    let mut a = worker(&env, &remote, &[]);
    submit_conf(&env, "conf-check", json!({"steps": 3, "sleep_ms": 600000})).await;
    // Its `waiting` event comes after its index entry (`hold.<id>`), which
    // the check lists the kind's active jobs by.
    env.wait_event("conf-check", "waiting", Duration::from_secs(20))
        .await;
    a.kill9();
    let before = env.jobs.get("conf-check").await.unwrap().unwrap().revision;
    let events_before = env.events_of("conf-check").await.len();
    // The new build: step 1 is now named `tally`.
    let port2 = free_port();
    let _s2 = service(
        sdk,
        port2,
        "http://127.0.0.1:9",
        &[("CONFORMANCE_CODE_VERSION", "2")],
    )
    .await;
    let check = |url: String| {
        let env = &env;
        async move {
            let (code, out, err) = cli(
                &env.url(),
                &[
                    "journal",
                    "check",
                    "--kind",
                    "conformance",
                    "--",
                    "--remote-kind",
                    &format!("conformance={url}"),
                ],
            )
            .await;
            let lines: Vec<Value> = out
                .lines()
                .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
                .collect();
            (code, lines, err)
        }
    };
    let (code, lines, err) = check(url(port2)).await;
    assert_eq!(code, 1, "a job would park: {lines:?} {err}");
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(
        (&lines[0]["id"], &lines[0]["verdict"], &lines[0]["steps"]),
        (&json!("conf-check"), &json!("mismatch"), &json!(3)),
        "{lines:?}"
    );
    let why = lines[0]["why"].as_str().unwrap();
    assert!(why.contains("count#1") && why.contains("tally#0"), "{why}");
    // The build it runs on now: it matches, and runs its sleep next.
    let (code, lines, err) = check(url(port)).await;
    assert_eq!(code, 0, "{lines:?} {err}");
    assert_eq!(
        (&lines[0]["verdict"], &lines[0]["next"]),
        (&json!("matches"), &json!("sleep#0")),
        "{lines:?}"
    );
    // Nothing was written by either check.
    let after = env.jobs.get("conf-check").await.unwrap().unwrap().revision;
    assert_eq!(after, before, "the record is untouched");
    assert_eq!(env.events_of("conf-check").await.len(), events_before);
}

// ---- the protocol's schemas -----------------------------------------------

fn schemas() -> std::collections::BTreeMap<String, jsonschema::Validator> {
    let dir = repo().join("proto/worker-protocol/v1");
    let mut out = std::collections::BTreeMap::new();
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "json") {
            let v: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
            let name = p.file_stem().unwrap().to_string_lossy().to_string();
            let validator = jsonschema::validator_for(&v)
                .unwrap_or_else(|e| panic!("{} does not compile: {e}", p.display()));
            out.insert(name, validator);
        }
    }
    out
}

fn check(
    schemas: &std::collections::BTreeMap<String, jsonschema::Validator>,
    schema: &str,
    v: &Value,
) {
    let errors: Vec<String> = schemas[schema]
        .iter_errors(v)
        .map(|e| format!("{}: {e}", e.instance_path()))
        .collect();
    assert!(errors.is_empty(), "{schema}: {errors:?} in {v}");
}

#[tokio::test]
async fn remote_protocol_examples_and_the_workers_real_messages_match_the_schemas() {
    let s = schemas();
    assert!(s.len() >= 7, "{:?}", s.keys());
    // Every example matches the schema its name starts with.
    let dir = repo().join("proto/worker-protocol/v1/examples");
    let mut examples = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().to_string();
        let schema = name.split('.').next().unwrap();
        let v: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        check(&s, schema, &v);
        examples += 1;
    }
    assert!(examples >= 10);
    // A wrong message does not.
    assert!(!s["invoke-answer"].is_valid(
        &json!({"protocol": 1, "op": "step", "index": "zero", "id": "a#0", "result": 1})
    ));
    assert!(!s["invoke-answer"].is_valid(&json!({"protocol": 1, "op": "teleport"})));

    // The worker's real requests, and a service's answers, in one run
    // through a step, an effect reconciled after a timeout, and the end.
    let env = env().await;
    let (b, base) = bad_service().await;
    let _w = worker(&env, &format!("bad={base}/"), &[]);
    env.submit("bad", json!({"input": {"bad": "record"}}), "schema-1")
        .await;
    let rec = ended(&env, "schema-1").await;
    assert_eq!(rec.status, "completed", "{rec:?}");
    let mut seen = std::collections::BTreeSet::new();
    for line in b.output().lines() {
        let Some((dir, rest)) = line.split_once(' ') else {
            continue;
        };
        if dir != "REQ" && dir != "ANS" {
            continue;
        }
        let Some((path, body)) = rest.split_once(' ') else {
            continue;
        };
        let v: Value = serde_json::from_str(body).unwrap();
        let schema = match (dir, path) {
            ("REQ", "/invoke") => "invoke-request",
            ("ANS", "/invoke") => "invoke-answer",
            ("REQ", p) if p.ends_with("/find_existing") => "find-existing-request",
            ("ANS", p) if p.ends_with("/find_existing") => "find-existing-answer",
            ("REQ", _) => "tool-request",
            ("ANS", _) => "tool-answer",
            _ => continue,
        };
        check(&s, schema, &v);
        seen.insert(schema);
    }
    assert_eq!(
        seen.len(),
        6,
        "every message type seen: {seen:?}\n{}",
        b.output()
    );
}

/// An SDK's answers to the protocol's example requests match the schemas:
/// `invoke` answers, a tool's error (its destination is down) and a
/// `find_existing` answer.
async fn sdk_answers_match_the_schemas(sdk: Sdk) {
    let s = schemas();
    let dir = repo().join("proto/worker-protocol/v1/examples");
    let port = free_port();
    let _svc = service(sdk, port, "http://127.0.0.1:9", &[]).await;
    let http = reqwest::Client::new();
    let post = |path: &'static str, body: Value| {
        let http = http.clone();
        async move {
            let r = http
                .post(format!("http://127.0.0.1:{port}{path}"))
                .json(&body)
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        }
    };
    let example = |name: &str| -> Value {
        serde_json::from_str(&std::fs::read_to_string(dir.join(format!("{name}.json"))).unwrap())
            .unwrap()
    };
    for name in ["invoke-request.first", "invoke-request.paged"] {
        let mut req = example(name);
        req["job"]["kind"] = json!("conformance");
        let (status, v) = post("/invoke", req).await;
        assert_eq!(status, 200, "{v}");
        check(&s, "invoke-answer", &v);
    }
    let (status, v) = post(
        "/tools/create_invoice",
        example("tool-request.create_invoice"),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    check(&s, "error", &v);
    assert_eq!(v["error"]["code"], "retryable", "{v}");
    let (status, v) = post(
        "/tools/create_invoice/find_existing",
        example("find-existing-request.create_invoice"),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    check(&s, "find-existing-answer", &v);
    assert_eq!(v["status"], "unavailable", "{v}");
}

async fn a_signed_service_serves_a_signed_worker_and_refuses_another(sdk: Sdk) {
    let env = env().await;
    let port = free_port();
    let _s = service(
        sdk,
        port,
        "http://127.0.0.1:9",
        &[
            ("LEASEHOLD_TOKEN", "tok-1"),
            ("LEASEHOLD_HMAC_SECRET", "sec-1"),
        ],
    )
    .await;
    let remote = format!("conformance={}", url(port));
    let mut good = worker(
        &env,
        &remote,
        &[
            ("LH_REMOTE_TOKEN", "tok-1"),
            ("LH_REMOTE_HMAC_SECRET", "sec-1"),
        ],
    );
    submit_conf(&env, "conf-signed", json!({"steps": 2})).await;
    let rec = ended(&env, "conf-signed").await;
    assert_eq!(rec.status, "completed", "{rec:?}");
    good.kill9();
    // A worker signing with another secret is refused: a clear, terminal error.
    let _bad = worker(
        &env,
        &remote,
        &[
            ("LH_REMOTE_TOKEN", "tok-1"),
            ("LH_REMOTE_HMAC_SECRET", "wrong"),
        ],
    );
    submit_conf(&env, "conf-unsigned", json!({"steps": 2})).await;
    let rec = ended(&env, "conf-unsigned").await;
    assert_eq!(rec.status, "failed", "{rec:?}");
    let m = error_of(&rec);
    assert!(m.contains("unauthorized") && m.contains("signature"), "{m}");
    assert!(steps(&env.events_of("conf-unsigned").await).is_empty());
}

/// Two kinds of two teams on one worker, each service with its own token
/// and secret: each kind's `--remote-kind` names its own variables
/// (`;token=VAR;secret=VAR`), and the worker signs each service's calls
/// with that service's secret. Swapped, both are refused.
async fn two_kinds_of_two_teams_hold_their_own_secrets(sdk: Sdk) {
    let env = env().await;
    let (pa, pb) = (free_port(), free_port());
    let team_a: &[(&'static str, &str)] = &[
        ("LEASEHOLD_TOKEN", "tok-a"),
        ("LEASEHOLD_HMAC_SECRET", "sec-a"),
    ];
    let team_b: &[(&'static str, &str)] = &[
        ("LEASEHOLD_TOKEN", "tok-b"),
        ("LEASEHOLD_HMAC_SECRET", "sec-b"),
    ];
    let _a = service(sdk, pa, "http://127.0.0.1:9", team_a).await;
    let _b = service(sdk, pb, "http://127.0.0.1:9", team_b).await;
    let remote = format!(
        "conformance={};token=TEAM_A_TOKEN;secret=TEAM_A_SECRET,echo-remote={};token=TEAM_B_TOKEN;secret=TEAM_B_SECRET",
        url(pa),
        url(pb)
    );
    let held = [
        ("TEAM_A_TOKEN", "tok-a"),
        ("TEAM_A_SECRET", "sec-a"),
        ("TEAM_B_TOKEN", "tok-b"),
        ("TEAM_B_SECRET", "sec-b"),
        // The shared variables would be wrong for both services.
        ("LH_REMOTE_TOKEN", "tok-shared"),
        ("LH_REMOTE_HMAC_SECRET", "sec-shared"),
    ];
    let mut w = worker(&env, &remote, &held);
    submit_conf(&env, "team-a-1", json!({"steps": 2})).await;
    env.submit("echo-remote", json!({"input": {"team": "b"}}), "team-b-1")
        .await;
    let a = ended(&env, "team-a-1").await;
    assert_eq!(a.status, "completed", "{a:?}");
    let b = ended(&env, "team-b-1").await;
    assert_eq!(b.status, "completed", "{b:?}");
    assert_eq!(output(&b), json!({"team": "b"}));
    w.kill9();
    // Each kind given the other team's secret: both refused, clearly.
    let swapped = [
        ("TEAM_A_TOKEN", "tok-a"),
        ("TEAM_A_SECRET", "sec-b"),
        ("TEAM_B_TOKEN", "tok-b"),
        ("TEAM_B_SECRET", "sec-a"),
    ];
    let _w2 = worker(&env, &remote, &swapped);
    submit_conf(&env, "team-a-2", json!({"steps": 2})).await;
    env.submit("echo-remote", json!({"input": {}}), "team-b-2")
        .await;
    for id in ["team-a-2", "team-b-2"] {
        let rec = ended(&env, id).await;
        assert_eq!(rec.status, "failed", "{rec:?}");
        let m = error_of(&rec);
        assert!(
            m.contains("unauthorized") && m.contains("signature"),
            "{id}: {m}"
        );
    }
}

/// A kind naming a variable that is not set: the worker refuses to start,
/// naming the kind and the variable (never serving it unsigned).
#[tokio::test]
async fn remote_a_kind_naming_an_unset_secret_variable_stops_the_worker_at_start() {
    let env = env().await;
    let mut w = worker(
        &env,
        "conformance=http://127.0.0.1:9/;secret=TEAM_C_SECRET",
        &[],
    );
    let st = w
        .wait_timeout(Duration::from_secs(20))
        .expect("the worker exits");
    assert!(!st.success(), "{st:?}");
    let out = w.output();
    assert!(
        out.contains("--remote-kind conformance") && out.contains("TEAM_C_SECRET is not set"),
        "{out}"
    );
}

async fn conformance_a_slow_service_past_the_attempt_deadline_is_stopped_and_retried(sdk: Sdk) {
    let (env, s, _port, remote) = conformance_env(sdk).await;
    // The call may take 30 s; the attempt may not take more than 2.
    let _w = worker(&env, &remote, &[("LH_ATTEMPT_TIMEOUT", "2s")]);
    submit_conf(
        &env,
        "conf-deadline",
        json!({"steps": 2, "slow_step": 1, "slow_s": 6, "slow_epoch": 1}),
    )
    .await;
    wait_log(
        &s,
        "step 1 of conf-deadline epoch 1",
        Duration::from_secs(20),
    )
    .await;
    let rec = ended(&env, "conf-deadline").await;
    assert_eq!(rec.status, "completed", "{rec:?}");
    assert!(rec.epoch >= 2, "a later attempt finished it: {rec:?}");
    let events = env.events_of("conf-deadline").await;
    let st = steps(&events);
    assert_eq!(st, ["count#0", "count#1"], "{st:?}");
    assert!(
        events
            .iter()
            .filter(|e| e.r#type == "step" && e.data_map()["id"] == "count#1")
            .all(|e| e.epoch >= 2),
        "the stopped attempt's late answer was not recorded"
    );
}

#[tokio::test]
async fn remote_python_sdk_unit_tests_pass() {
    let root = repo();
    let mut cmd = tokio::process::Command::new(python());
    cmd.args(["-m", "unittest", "discover", "-s"])
        .arg(root.join("sdks/python/tests"));
    if std::env::var_os("LH_PYTHON").is_none() {
        cmd.env("PYTHONPATH", root.join("sdks/python/src"));
    }
    let out = cmd.output().await.expect("run python");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("OK"), "{err}");
}

async fn generate_runs_the_model_in_the_worker_and_is_recorded_once(sdk: Sdk) {
    let mut o = SetupOptions {
        ack_wait: ACK_WAIT,
        ..SetupOptions::default()
    };
    o.kinds.push("writer".into());
    let env = Fleet::with(o).await;
    let (_sim, sim) = spawn_sim(&[]).await;
    let port = free_port();
    let _s = service(sdk, port, &sim, &[]).await;
    let model = format!("{sim}/v1");
    let _w = worker(
        &env,
        &format!("writer={}", url(port)),
        &[("LH_MODEL_BASE_URL", &model)],
    );
    env.submit("writer", json!({"input": {}}), "gen-1").await;
    let rec = ended(&env, "gen-1").await;
    assert_eq!(rec.status, "completed", "{rec:?}");
    let out = output(&rec);
    assert!(!out["text"].as_str().unwrap_or("").is_empty(), "{out}");
    assert!(out["model_calls"].as_u64().unwrap_or(0) >= 1, "{out}");
    let events = env.events_of("gen-1").await;
    assert_eq!(steps(&events), ["topic#0", "generate:generate#0"]);
    assert!(
        events.iter().any(|e| e.r#type == "agent"),
        "the conversation's transcript is journaled"
    );
}

async fn sim_chat_requests(sim: &str) -> u64 {
    let v: Value = reqwest::get(format!("{sim}/stats"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    v["chat_requests"].as_u64().unwrap()
}

async fn a_kill_9_of_the_worker_during_generate_repeats_only_the_model_call(sdk: Sdk) {
    let mut o = SetupOptions {
        ack_wait: ACK_WAIT,
        ..SetupOptions::default()
    };
    o.kinds.push("writer".into());
    let env = Fleet::with(o).await;
    // Paced tokens: the answer takes a while to stream.
    let (_sim, sim) = spawn_sim(&[("LH_SIM_TOKEN_DELAY_MS", "40".into())]).await;
    let port = free_port();
    let _s = service(sdk, port, &sim, &[]).await;
    let model = format!("{sim}/v1");
    let remote = format!("writer={}", url(port));
    let extra: &[(&'static str, &str)] = &[("LH_MODEL_BASE_URL", &model)];
    let mut journal = env
        .conn
        .client
        .subscribe(env.conn.layout.event_subject("gen-kill", "agent"))
        .await
        .unwrap();
    let mut a = worker(&env, &remote, extra);
    env.submit("writer", json!({"input": {}}), "gen-kill").await;
    // The conversation's thread is durable, then the model call starts.
    tokio::time::timeout(
        Duration::from_secs(30),
        futures::StreamExt::next(&mut journal),
    )
    .await
    .expect("the transcript's first entry");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while sim_chat_requests(&sim).await < 1 {
        assert!(tokio::time::Instant::now() < deadline, "no model call");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    a.kill9();
    let _b = worker(&env, &remote, extra);
    let rec = ended(&env, "gen-kill").await;
    assert_eq!(rec.status, "completed", "{rec:?}");
    assert!(rec.epoch >= 2, "{rec:?}");
    assert_eq!(
        sim_chat_requests(&sim).await,
        2,
        "the call in flight, and its one repetition"
    );
    let st = steps(&env.events_of("gen-kill").await);
    assert_eq!(st, ["topic#0", "generate:generate#0"], "each once: {st:?}");
}

/// `generate` offered the service's tools: the model's `search` (a read)
/// runs through the service's `/tools/search`, its `fetch` (a write: the
/// page filed in an archive) through the worker's effects ledger with a
/// stable idempotency key. A kill -9 of the worker once the write was made
/// (the model's last answer streaming) repeats neither the write nor the
/// step: one copy in the archive, the answer recorded once.
async fn generate_with_tools_reads_directly_and_writes_once(sdk: Sdk) {
    let mut o = SetupOptions {
        ack_wait: ACK_WAIT,
        ..SetupOptions::default()
    };
    o.kinds.push("scout".into());
    let env = Fleet::with(o).await;
    let (_sim, sim) = spawn_sim(&[("LH_SIM_TOKEN_DELAY_MS", "20".into())]).await;
    let dir = tempfile::tempdir().unwrap();
    let archive = dir.path().join("archive.jsonl");
    let port = free_port();
    let archive_s = archive.display().to_string();
    let s = service(sdk, port, &sim, &[("SCOUT_ARCHIVE_FILE", &archive_s)]).await;
    let model = format!("{sim}/v1");
    let remote = format!("scout={}", url(port));
    let extra: &[(&'static str, &str)] = &[("LH_MODEL_BASE_URL", &model)];
    let mut a = worker(&env, &remote, extra);
    env.submit("scout", json!({"input": {}}), "scout-1").await;
    wait_log(&s, "tool fetch ", Duration::from_secs(30)).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while sim_chat_requests(&sim).await < 3 {
        assert!(tokio::time::Instant::now() < deadline, "no last answer");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    a.kill9();
    let _b = worker(&env, &remote, extra);
    let rec = ended(&env, "scout-1").await;
    assert_eq!(rec.status, "completed", "{rec:?}");
    assert!(rec.epoch >= 2, "{rec:?}");
    let out = output(&rec);
    assert!(
        out["text"].as_str().unwrap_or("").contains("/page/"),
        "the answer cites the fetched page: {out}"
    );
    let said = s.output();
    assert!(said.contains("tool search "), "the read ran: {said}");
    assert_eq!(
        said.matches("tool fetch ").count(),
        1,
        "the write ran once: {said}"
    );
    let lines = std::fs::read_to_string(&archive).unwrap();
    assert_eq!(lines.lines().count(), 1, "one copy filed: {lines}");
    let filed: Value = serde_json::from_str(lines.lines().next().unwrap()).unwrap();
    let key = filed["key"].as_str().unwrap();
    assert!(
        key.len() == 64 && key.chars().all(|c| c.is_ascii_hexdigit()),
        "a stable idempotency key: {key}"
    );
    // The write went through the ledger, under the key the tool was sent.
    let ledger = leasehold_testkit::doors::ledger::EffectsLedger::open(
        &env.conn.js,
        &env.conn.layout.effects_bucket(),
    )
    .await
    .unwrap();
    let (entry, _) = ledger
        .get("scout-1", key)
        .await
        .unwrap()
        .expect("the write's ledger entry");
    assert_eq!(entry.tool, "fetch", "{entry:?}");
    assert_eq!(
        entry.state,
        leasehold_testkit::doors::ledger::EffectState::Done,
        "{entry:?}"
    );
    assert_eq!(entry.result.as_ref(), Some(&filed["result"]), "{entry:?}");
    let st = steps(&env.events_of("scout-1").await);
    assert_eq!(st, ["topic#0", "generate:generate#0"], "each once: {st:?}");
}

// ---- every door keeps the promise -----------------------------------------

/// G3: the tool appends its line, then its process dies before it answers
/// (the worker's connection closes after the request was sent), and its
/// supervisor (this test) starts it again. The effect may have happened,
/// so the key stays in flight and the next attempt asks `find_existing`
/// first: one line at the destination, never two.
#[tokio::test]
async fn remote_a_tool_that_dies_after_its_effect_is_reconciled_not_called_again() {
    let env = env().await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("dest.txt");
    let extra = [("APPEND_FILE", file.display().to_string())];
    let port = free_port();
    let mut s = doors_service(port, &extra).await;
    let _w = worker(&env, &format!("append={}", url(port)), &[]);
    env.submit(
        "append",
        json!({"input": {"line": "pay 120 EUR"}}),
        "door-append",
    )
    .await;
    // The supervisor: the service dies in its first tool call; start it again.
    wait_log(&s, "dying before the answer", Duration::from_secs(20)).await;
    assert!(
        s.wait_timeout(Duration::from_secs(10)).is_some(),
        "the service exits"
    );
    let _s2 = doors_service(port, &extra).await;
    let rec = ended(&env, "door-append").await;
    assert_eq!(rec.status, "completed", "{rec:?}");
    let lines = std::fs::read_to_string(&file).unwrap();
    assert_eq!(
        lines.lines().count(),
        1,
        "one effect at the destination, never two: {lines:?}"
    );
    let events = env.events_of("door-append").await;
    assert!(
        events
            .iter()
            .any(|e| e.r#type == "tool" && e.data.contains("found at the destination")),
        "the next attempt reconciled with find_existing: {:?}",
        events
            .iter()
            .filter(|e| e.r#type == "tool")
            .map(|e| &e.data)
            .collect::<Vec<_>>()
    );
    assert_eq!(count(&steps(&events), "effect:append#0"), 1);
}

/// G2 for a remote kind: the first gate's answer is that gate's only; the
/// Python service's second `ctx.park` parks the job again (reason
/// `approve-2`), and its own answer comes back to it.
#[tokio::test]
async fn remote_a_second_park_asks_again_and_never_takes_the_first_parks_answer() {
    let env = env().await;
    let port = free_port();
    let _s = doors_service(port, &[]).await;
    let _w = worker(&env, &format!("gates={}", url(port)), &[]);
    env.submit("gates", json!({"input": {}}), "rgates-1").await;
    let rec = ended(&env, "rgates-1").await;
    assert_eq!(rec.status, "parked", "{rec:?}");
    assert_eq!(rec.parked_reason.as_deref(), Some("approve-1"));
    let resume = |answer: &'static str| {
        let url = env.url();
        async move {
            let (code, _, err) =
                cli(&url, &["review", "resume", "rgates-1", "--answer", answer]).await;
            assert_eq!(code, 0, "{err}");
        }
    };
    resume(r#"{"approve": 1}"#).await;
    let rec = env
        .wait_for("rgates-1", Duration::from_secs(30), |r| {
            r.status == "completed"
                || (r.status == "parked" && r.parked_reason.as_deref() == Some("approve-2"))
        })
        .await;
    assert_eq!(rec.status, "parked", "the second gate asks: {rec:?}");
    resume(r#"{"approve": 2}"#).await;
    let rec = env
        .wait_status("rgates-1", "completed", Duration::from_secs(30))
        .await;
    assert_eq!(
        output(&rec),
        json!({"first": {"approve": 1}, "second": {"approve": 2}, "between": 1})
    );
    let s = steps(&env.events_of("rgates-1").await);
    assert_eq!(s, ["park#0", "between#0", "park#1"], "{s:?}");
}

/// G10: a signed request (as a worker signs it: `leasehold::signature`,
/// captured on the wire) replayed to another endpoint, a tool instead of
/// its `find_existing`, or to the same one again, is refused: 401, and the
/// tool never runs.
#[tokio::test]
async fn remote_a_signed_call_replayed_or_sent_to_another_endpoint_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("dest.txt");
    let port = free_port();
    let _s = doors_service(
        port,
        &[
            ("LEASEHOLD_HMAC_SECRET", "sec-1".into()),
            ("APPEND_FILE", file.display().to_string()),
        ],
    )
    .await;
    let body = json!({
        "protocol": 1, "type": "find_existing", "tool": "append",
        "args": {"line": "pay 120 EUR"}, "business_key": null, "idempotency_key": "k-1",
    })
    .to_string();
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let find = "/tools/append/find_existing";
    let signed = leasehold::signature("sec-1", t, "nonce-1", "POST", find, body.as_bytes());
    let http = reqwest::Client::new();
    let post = |path: &'static str| {
        let (http, body, signed) = (http.clone(), body.clone(), signed.clone());
        async move {
            let r = http
                .post(format!("http://127.0.0.1:{port}{path}"))
                .header("content-type", "application/json")
                .header(leasehold::SIGNATURE_HEADER, signed)
                .body(body)
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            (status, r.json::<Value>().await.unwrap())
        }
    };
    // The captured request sent to the tool itself: refused, nothing runs.
    let (status, v) = post("/tools/append").await;
    assert_eq!(status, 401, "{v}");
    assert_eq!(v["error"]["code"], "unauthorized", "{v}");
    // Where it was signed for: served once.
    let (status, v) = post(find).await;
    assert_eq!(
        (status, v["status"].as_str()),
        (200, Some("not_found")),
        "{v}"
    );
    // Replayed: refused.
    let (status, v) = post(find).await;
    assert_eq!(status, 401, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("used before"),
        "{v}"
    );
    assert!(!file.exists(), "the tool never ran");
}

/// G16: business keys are scoped by the remote kind. Two kinds with the
/// same tool and business key are two effects: kind B's service neither
/// reads kind A's result nor has its own effect suppressed.
#[tokio::test]
async fn remote_business_keys_belong_to_their_kind() {
    let env = env().await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("dest.txt");
    // The tool's first-call death is for another test.
    std::fs::write(dir.path().join("dest.txt.died"), "").unwrap();
    let port = free_port();
    let _s = doors_service(port, &[("APPEND_FILE", file.display().to_string())]).await;
    let _w = worker(&env, &format!("bka={u},bkb={u}", u = url(port)), &[]);
    env.submit("bka", json!({"input": {}}), "bk-a").await;
    let a = ended(&env, "bk-a").await;
    assert_eq!(a.status, "completed", "{a:?}");
    env.submit("bkb", json!({"input": {}}), "bk-b").await;
    let b = ended(&env, "bk-b").await;
    assert_eq!(b.status, "completed", "{b:?}");
    assert_eq!(output(&a), json!({"line": "bka"}));
    assert_eq!(output(&b), json!({"line": "bkb"}), "kind B's own effect");
    let lines = std::fs::read_to_string(&file).unwrap();
    assert_eq!(lines.lines().count(), 2, "{lines:?}");
}

// ---- both SDKs ------------------------------------------------------------

/// Each test function once per SDK: under its own name for the Python SDK
/// (or `LH_REMOTE_SERVICE`'s), in `typescript::` for the TypeScript one.
macro_rules! both_sdks {
    ($($test:ident => $case:ident,)*) => {
        $(
            #[tokio::test]
            async fn $test() {
                $case(Sdk::Python).await
            }
        )*

        /// The same cases against the TypeScript SDK (`sdks/typescript`)
        /// serving `examples/invoice-typescript/app.js`.
        mod typescript {
            use super::*;
            $(
                #[tokio::test]
                async fn $test() {
                    $case(Sdk::TypeScript).await
                }
            )*
        }
    };
}

both_sdks! {
    remote_invoice_books_one_invoice_through_durable_steps
        => invoice_books_one_invoice_through_durable_steps,
    remote_worker_killed_right_after_the_commit_leaves_one_invoice
        => worker_killed_right_after_the_commit_leaves_one_invoice,
    remote_service_killed_mid_step_is_called_again_and_books_one_invoice
        => service_killed_mid_step_is_called_again_and_books_one_invoice,
    remote_timeout_after_the_commit_is_reconciled_not_repeated
        => timeout_after_the_commit_is_reconciled_not_repeated,
    remote_the_same_invoice_asked_for_again_is_the_first_one
        => the_same_invoice_asked_for_again_is_the_first_one,
    remote_a_persons_answer_comes_back_to_the_park_that_asked
        => a_persons_answer_comes_back_to_the_park_that_asked,
    remote_conformance_kill_9_of_the_worker_mid_step_resumes_from_the_journal
        => conformance_kill_9_of_the_worker_mid_step_resumes_from_the_journal,
    remote_conformance_kill_9_of_the_service_mid_step_and_after_its_answer
        => conformance_kill_9_of_the_service_mid_step_and_after_its_answer,
    remote_conformance_a_duplicate_call_gets_the_same_answer_and_records_nothing
        => conformance_a_duplicate_call_gets_the_same_answer_and_records_nothing,
    remote_conformance_a_stale_epochs_late_answer_writes_nothing
        => conformance_a_stale_epochs_late_answer_writes_nothing,
    remote_conformance_a_journal_mismatch_after_a_code_change_parks_with_both_steps
        => conformance_a_journal_mismatch_after_a_code_change_parks_with_both_steps,
    remote_conformance_a_slow_service_past_the_call_deadline_is_retried
        => conformance_a_slow_service_past_the_call_deadline_is_retried,
    remote_conformance_a_slow_service_past_the_attempt_deadline_is_stopped_and_retried
        => conformance_a_slow_service_past_the_attempt_deadline_is_stopped_and_retried,
    remote_conformance_a_signal_wakes_a_waiting_job_and_one_sent_before_is_kept
        => conformance_a_signal_wakes_a_waiting_job_and_one_sent_before_is_kept,
    remote_conformance_a_parent_waits_for_its_children_and_gets_every_outcome
        => conformance_a_parent_waits_for_its_children_and_gets_every_outcome,
    remote_conformance_a_journal_check_lists_the_jobs_a_code_change_would_park
        => conformance_a_journal_check_lists_the_jobs_a_code_change_would_park,
    remote_conformance_a_malformed_call_gets_a_clear_error_and_the_service_lives
        => conformance_a_malformed_call_gets_a_clear_error_and_the_service_lives,
    remote_conformance_an_oversized_journal_is_paged
        => conformance_an_oversized_journal_is_paged,
    remote_conformance_a_retry_waits_queued_for_its_delay_without_a_slot
        => conformance_a_retry_waits_queued_for_its_delay_without_a_slot,
    remote_conformance_a_sleep_waits_without_a_slot_and_resumes_at_its_time
        => conformance_a_sleep_waits_without_a_slot_and_resumes_at_its_time,
    remote_sdk_answers_match_the_schemas => sdk_answers_match_the_schemas,
    remote_a_signed_service_serves_a_signed_worker_and_refuses_another
        => a_signed_service_serves_a_signed_worker_and_refuses_another,
    remote_two_kinds_of_two_teams_hold_their_own_secrets
        => two_kinds_of_two_teams_hold_their_own_secrets,
    remote_generate_runs_the_model_in_the_worker_and_is_recorded_once
        => generate_runs_the_model_in_the_worker_and_is_recorded_once,
    remote_a_kill_9_of_the_worker_during_generate_repeats_only_the_model_call
        => a_kill_9_of_the_worker_during_generate_repeats_only_the_model_call,
    remote_generate_with_tools_reads_directly_and_writes_once
        => generate_with_tools_reads_directly_and_writes_once,
}

/// The TypeScript SDK's own tests (`node --test`, real sockets), against
/// the installed package when `LH_TYPESCRIPT_SDK` names it.
#[tokio::test]
async fn remote_typescript_sdk_unit_tests_pass() {
    let root = repo();
    let pkg = match std::env::var_os("LH_TYPESCRIPT_SDK") {
        Some(prefix) => PathBuf::from(prefix).join("node_modules/leasehold"),
        None => root.join("sdks/typescript"),
    };
    let out = tokio::process::Command::new(node())
        .arg("--test")
        .arg(root.join("sdks/typescript/test"))
        .env("LEASEHOLD_SDK", &pkg)
        .output()
        .await
        .expect("run node (make setup installs it)");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    assert!(text.contains("# fail 0"), "{text}");
}
