//! The public SDK's durable steps against a real nats-server, with an
//! in-process worker built as a user builds theirs (`leasehold::Worker`):
//! a recorded step never runs again; a resumed attempt whose code asks for
//! other steps, or whose recorded result no longer decodes, parks the job
//! with the reason instead of guessing.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use leasehold::{Ctx, Error, Kind};
use leasehold_store::setup::SetupOptions;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use crate::support::*;

/// What the test kind does in each attempt (the "code" of that attempt).
#[derive(Default)]
struct Script {
    /// Which code the next attempt runs: 0 the first version, 1 the changed one.
    version: AtomicU32,
    /// How often each step's closure ran.
    ran_a: AtomicU32,
    ran_b: AtomicU32,
}

struct Steps(Arc<Script>);

#[leasehold::async_trait]
impl Kind for Steps {
    async fn run(&self, ctx: &Ctx) -> Result<Value, Error> {
        let s = &self.0;
        let v = s.version.load(Ordering::SeqCst);
        let mode = ctx.input_json()["mode"].as_str().unwrap_or("").to_string();
        let a: u64 = ctx
            .step("a", || async {
                s.ran_a.fetch_add(1, Ordering::SeqCst);
                Ok(7)
            })
            .await?;
        if v == 0 {
            let _: String = ctx
                .step("b", || async {
                    s.ran_b.fetch_add(1, Ordering::SeqCst);
                    Ok("b".to_string())
                })
                .await?;
            // The first version stops here, to be retried by a later attempt.
            s.version.store(1, Ordering::SeqCst);
            return Err(Error::retryable("first attempt ends"));
        }
        match mode.as_str() {
            // The changed code asks for another step where `b` was.
            "reorder" => {
                let _: u64 = ctx.step("c", || async { Ok(1) }).await?;
            }
            // The changed code reads `b`'s result as a number.
            "retype" => {
                let _: u64 = ctx.step("b", || async { Ok(1) }).await?;
            }
            _ => {
                let b: String = ctx.step("b", || async { Ok("again".to_string()) }).await?;
                return Ok(json!({"a": a, "b": b}));
            }
        }
        Ok(json!({"a": a}))
    }
}

async fn run(mode: &str) -> (Env, Arc<Script>, leasehold_core::JobRecord) {
    let mut o = SetupOptions {
        ack_wait: ACK_WAIT,
        ..SetupOptions::default()
    };
    o.kinds.push("steps".into());
    let env = Env::with(o).await;
    let script = Arc::new(Script::default());
    let mut opts = env.opts();
    opts.kinds = vec!["steps".into()];
    opts.retry_base = Duration::from_millis(10);
    opts.retry_cap = Duration::from_millis(20);
    let stop = CancellationToken::new();
    let _h = leasehold::Worker::new(opts)
        .kind("steps", Steps(script.clone()))
        .start(stop.clone())
        .await
        .unwrap();
    env.submit("steps", json!({"input": {"mode": mode}}), "s-1")
        .await;
    let rec = env
        .wait_for("s-1", Duration::from_secs(20), |r| {
            matches!(r.status.as_str(), "completed" | "failed" | "parked")
        })
        .await;
    stop.cancel();
    (env, script, rec)
}

#[tokio::test]
async fn a_recorded_step_never_runs_again_in_a_later_attempt() {
    let (_env, s, rec) = run("same").await;
    assert_eq!(rec.status, "completed", "{rec:?}");
    assert_eq!(rec.attempts, 1, "one failed attempt before");
    assert_eq!(s.ran_a.load(Ordering::SeqCst), 1, "a replayed, not run");
    assert_eq!(s.ran_b.load(Ordering::SeqCst), 1);
    let out: Value = serde_json::from_str(&rec.result.unwrap().output).unwrap();
    // `b` comes from the journal: the second closure never ran.
    assert_eq!(out, json!({"a": 7, "b": "b"}));
}

#[tokio::test]
async fn a_changed_step_order_parks_the_job_with_both_steps_named() {
    let (_env, _s, rec) = run("reorder").await;
    assert_eq!(rec.status, "parked", "{rec:?}");
    assert_eq!(rec.parked_reason.as_deref(), Some("journal_mismatch"));
    let msg = rec.error.map(|e| e.message).unwrap_or_default();
    assert!(msg.contains("`b#0`") && msg.contains("`c#0`"), "{msg}");
}

#[tokio::test]
async fn a_recorded_result_that_no_longer_decodes_parks_the_job() {
    let (_env, _s, rec) = run("retype").await;
    assert_eq!(rec.status, "parked", "{rec:?}");
    assert_eq!(rec.parked_reason.as_deref(), Some("journal_mismatch"));
    let msg = rec.error.map(|e| e.message).unwrap_or_default();
    assert!(msg.contains("no longer decodes"), "{msg}");
}
