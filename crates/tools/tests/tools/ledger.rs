//! The effects ledger end to end: idempotency keys, reconciliation, business
//! keys, fault injection and read retries, against real KV and real HTTP.

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use leasehold_tools::{
    idempotency_key, incarnation_key, CallCtx, Disposition, EffectGuard, EffectState, ExecCtx,
    FaultMode, Outcome, Tool, ToolError, ToolEventKind, ToolKind, ToolSpec, Toolbox,
};
use serde_json::{json, Value};

use crate::support::{ctx, Env};

fn doc(n: u32) -> Value {
    json!({"title": "Report", "document": format!("# Report {n}\n\nLeases and fences.")})
}

/// The seed's invoice case: the write commits, the caller times out, the
/// retry reconciles; one effect, and the same result every time.
#[tokio::test]
async fn timeout_after_commit_then_retry_is_one_effect_with_one_result() {
    let env = Env::start().await;
    let tb = env.toolbox();
    let c = ctx("section-1#3");
    let args = doc(1);
    let key = idempotency_key("job-1", "section-1#3", "publish");

    tb.faults().fail_next(1, FaultMode::TimeoutAfterCommit);
    let first = tb.call(&c, "publish", &args).await.unwrap_err();
    assert!(matches!(first, ToolError::Timeout(_)), "{first:?}");
    assert_eq!(first.disposition(), Disposition::Retry);
    let (entry, _) = env.ledger.get("job-1", &key).await.unwrap().unwrap();
    assert_eq!(entry.state, EffectState::InFlight);

    let second = tb.call(&c, "publish", &args).await.unwrap();
    assert_eq!(second.outcome, Outcome::Reconciled);
    let third = tb.call(&c, "publish", &args).await.unwrap();
    assert_eq!(third.outcome, Outcome::Replayed);

    assert_eq!(env.sim.count().await, 1);
    let stored = env.sim.effect(&key).await.unwrap();
    assert_eq!(second.value, stored);
    assert_eq!(third.value, stored);
    assert_eq!(second.key, key);
    let kinds = env.events.kinds();
    assert!(kinds.contains(&ToolEventKind::Reconciled), "{kinds:?}");
    assert!(env.events.events().iter().all(|e| e.key == key));
}

/// An effect begun by a worker from before keys named the job's incarnation
/// keeps its key when a newer worker retries it: an upgrade in the middle
/// of a job never sends the effect again. A step with no such entry gets the
/// incarnation's key.
#[tokio::test]
async fn a_step_begun_under_the_key_without_incarnation_keeps_it() {
    let env = Env::start().await;
    let tb = env.toolbox();
    let args = doc(14);
    let legacy = idempotency_key("job-1", "section-14#1", "publish");
    tb.faults().fail_next(1, FaultMode::TimeoutAfterCommit);
    let old = ctx("section-14#1");
    assert!(tb.call(&old, "publish", &args).await.is_err());
    let upgraded = ctx("section-14#1").of_incarnation("2026-12-01T10:00:00Z");
    let r = tb.call(&upgraded, "publish", &args).await.unwrap();
    assert_eq!(r.outcome, Outcome::Reconciled);
    assert_eq!(r.key, legacy);
    assert_eq!(env.sim.count().await, 1);

    let fresh = ctx("section-15#1").of_incarnation("2026-12-01T10:00:00Z");
    let r = tb.call(&fresh, "publish", &doc(15)).await.unwrap();
    assert_eq!(
        r.key,
        incarnation_key("job-1", "2026-12-01T10:00:00Z", "section-15#1", "publish")
    );
}

/// The same, with a real hang at the sink (commit, then no answer within the
/// client's timeout) instead of the tool layer's injection.
#[tokio::test]
async fn sink_commit_then_timeout_then_retry_is_one_effect() {
    let env = Env::start().await;
    let tb = env.toolbox();
    let c = ctx("section-2#1");
    env.sim.arm("commit_then_timeout", 1).await;
    let err = tb.call(&c, "publish", &doc(2)).await.unwrap_err();
    assert!(matches!(err, ToolError::Timeout(_)), "{err:?}");
    let again = tb.call(&c, "publish", &doc(2)).await.unwrap();
    assert_eq!(again.outcome, Outcome::Reconciled);
    assert_eq!(env.sim.count().await, 1);
}

/// A timeout before anything left: the retry finds nothing at the
/// destination, which deduplicates by key, so it runs again with the same key.
#[tokio::test]
async fn timeout_before_commit_then_retry_runs_once_with_the_same_key() {
    let env = Env::start().await;
    let tb = env.toolbox();
    let c = ctx("section-3#1");
    tb.faults().fail_next(1, FaultMode::TimeoutBeforeCommit);
    assert!(matches!(
        tb.call(&c, "publish", &doc(3)).await,
        Err(ToolError::Timeout(_))
    ));
    assert_eq!(env.sim.count().await, 0);
    let out = tb.call(&c, "publish", &doc(3)).await.unwrap();
    assert_eq!(out.outcome, Outcome::Reconciled);
    assert_eq!(out.attempts, 1);
    assert_eq!(env.sim.count().await, 1);
}

/// Executors racing on one key (a stale owner and the new one after a
/// reclaim, and more): exactly one effect, all successful answers equal.
#[tokio::test]
async fn racing_executors_on_one_key_make_one_effect() {
    let env = Env::start().await;
    let boxes: Vec<Arc<Toolbox>> = (0..6).map(|_| Arc::new(env.toolbox())).collect();
    let args = doc(4);
    let mut tasks = Vec::new();
    for (i, tb) in boxes.iter().enumerate() {
        let tb = tb.clone();
        let args = args.clone();
        tasks.push(tokio::spawn(async move {
            let c = CallCtx::new("job-1", "section-4#1", i as u64 + 1);
            tb.call(&c, "publish", &args).await
        }));
    }
    let mut values = Vec::new();
    for t in tasks {
        if let Ok(out) = t.await.unwrap() {
            values.push(out.value);
        }
    }
    assert!(!values.is_empty());
    assert!(values.windows(2).all(|w| w[0] == w[1]), "{values:?}");
    assert_eq!(env.sim.count().await, 1);
}

/// Racing executors at a destination that does not deduplicate: never two
/// effects; a loser either replays or parks, or, if it is the older epoch
/// and meets the newer one's call in flight, is superseded (a stale owner).
#[tokio::test]
async fn racing_executors_without_dedupe_never_double_the_effect() {
    let env = Env::start().await;
    let mut config = env.config();
    config.publish.dedupes_by_key = false;
    let a = Arc::new(env.toolbox_with(config.clone()));
    let b = Arc::new(env.toolbox_with(config));
    // Slow the executions so both calls meet the other's `in_flight`.
    for tb in [&a, &b] {
        tb.faults().set_slow_delay(Duration::from_millis(200));
        tb.faults().fail_next(1, FaultMode::Slow);
    }
    let args = doc(5);
    let (ca, cb) = (
        CallCtx::new("job-1", "section-5#1", 1),
        CallCtx::new("job-1", "section-5#1", 2),
    );
    let (ra, rb) = tokio::join!(a.call(&ca, "publish", &args), b.call(&cb, "publish", &args));
    let oks = [&ra, &rb].iter().filter(|r| r.is_ok()).count();
    assert!(oks >= 1, "{ra:?} {rb:?}");
    if let Err(e) = &ra {
        assert!(
            e.disposition() == Disposition::Park || matches!(e, ToolError::Superseded { .. }),
            "{e:?}"
        );
    }
    if let Err(e) = &rb {
        assert_eq!(e.disposition(), Disposition::Park, "{e:?}");
    }
    assert_eq!(env.sim.count().await, 1);
}

/// A step's key is its job, step and tool: the same step asked again with
/// other arguments (a warm retry whose model re-worded the call) is refused
/// with both digests (as Stripe does), never sent.
#[tokio::test]
async fn the_same_step_with_other_arguments_is_refused() {
    let env = Env::start().await;
    let tb = env.toolbox();
    let c = ctx("section-6#1");
    let first = tb.call(&c, "publish", &doc(6)).await.unwrap();
    assert_eq!(first.outcome, Outcome::Executed);
    assert_eq!(
        first.key,
        idempotency_key("job-1", "section-6#1", "publish")
    );
    let mut reworded = doc(6);
    reworded["document"] = json!("# Report 6, put another way");
    let err = tb.call(&c, "publish", &reworded).await.unwrap_err();
    let ToolError::KeyReuse { key, stored, given } = &err else {
        panic!("{err:?}")
    };
    assert_eq!(*key, first.key);
    assert_eq!(*stored, leasehold_tools::arg_digest(&doc(6)));
    assert_eq!(*given, leasehold_tools::arg_digest(&reworded));
    assert_eq!(err.disposition(), Disposition::Park);
    assert_eq!(env.events.kinds().last(), Some(&ToolEventKind::Refused));
    assert_eq!(env.sim.count().await, 1, "nothing sent a second time");
    // The first arguments still replay.
    let again = tb.call(&c, "publish", &doc(6)).await.unwrap();
    assert_eq!(again.outcome, Outcome::Replayed);
    assert_eq!(again.value, first.value);
    // So does a key left in flight: other arguments are refused before any
    // reconciliation or execution.
    let c2 = ctx("section-6#2");
    tb.faults().fail_next(1, FaultMode::TimeoutAfterCommit);
    assert!(tb.call(&c2, "publish", &doc(60)).await.is_err());
    let err = tb.call(&c2, "publish", &doc(61)).await.unwrap_err();
    assert!(matches!(err, ToolError::KeyReuse { .. }), "{err:?}");
    assert_eq!(env.sim.count().await, 2);
}

/// An empty success body is a failure, not a result; the retry reconciles
/// the effect the sink did record.
#[tokio::test]
async fn empty_success_body_is_a_failure_not_a_result() {
    let env = Env::start().await;
    let tb = env.toolbox();
    let c = ctx("section-7#1");
    env.sim.arm("empty_success", 1).await;
    let err = tb.call(&c, "publish", &doc(7)).await.unwrap_err();
    assert!(matches!(err, ToolError::EmptySuccess), "{err:?}");
    assert_eq!(err.class(), "empty_success");
    let out = tb.call(&c, "publish", &doc(7)).await.unwrap();
    assert_eq!(out.outcome, Outcome::Reconciled);
    assert!(out.value["id"].is_string());
    assert_eq!(env.sim.count().await, 1);

    // The tool layer's own injection behaves the same.
    tb.faults().fail_next(1, FaultMode::EmptySuccess);
    let c2 = ctx("section-7#2");
    assert!(matches!(
        tb.call(&c2, "publish", &doc(8)).await,
        Err(ToolError::EmptySuccess)
    ));
    assert_eq!(
        tb.call(&c2, "publish", &doc(8)).await.unwrap().outcome,
        Outcome::Reconciled
    );
    assert_eq!(env.sim.count().await, 2);
}

/// A write tool whose destination cannot be asked about earlier effects.
struct Notify {
    spec: ToolSpec,
    url: String,
}

impl Tool for Notify {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }
    fn execute<'a>(
        &'a self,
        args: &'a Value,
        ctx: &'a ExecCtx,
    ) -> BoxFuture<'a, Result<Value, ToolError>> {
        Box::pin(async move {
            let r = reqwest::Client::new()
                .post(&self.url)
                .header("Idempotency-Key", &ctx.idempotency_key)
                .json(args)
                .send()
                .await
                .map_err(|e| ToolError::Transport(e.to_string()))?;
            r.json()
                .await
                .map_err(|e| ToolError::BadResponse(e.to_string()))
        })
    }
}

/// Outcome unknowable: the job is parked with the reason, never guessed.
#[tokio::test]
async fn unknowable_outcome_parks_with_the_reason() {
    let env = Env::start().await;
    let mut tb = env.toolbox();
    tb.register(Arc::new(Notify {
        spec: ToolSpec {
            name: "notify".into(),
            description: "send a notification".into(),
            kind: ToolKind::Write,
            schema: json!({"type": "object", "properties": {"to": {"type": "string"}}, "required": ["to"]}),
            timeout: Duration::from_secs(2),
        },
        url: format!("{}/effects", env.sim.base),
    }))
    .unwrap();
    let c = ctx("section-8#1");
    let args = json!({"to": "ops"});
    tb.faults().fail_next(1, FaultMode::TimeoutAfterCommit);
    assert!(matches!(
        tb.call(&c, "notify", &args).await,
        Err(ToolError::Timeout(_))
    ));
    let err = tb.call(&c, "notify", &args).await.unwrap_err();
    let ToolError::UncertainEffect { key, reason } = &err else {
        panic!("{err:?}")
    };
    assert_eq!(*key, idempotency_key("job-1", "section-8#1", "notify"));
    assert!(reason.contains("in flight"), "{reason}");
    assert_eq!(err.disposition(), Disposition::Park);
    assert_eq!(env.events.kinds().last(), Some(&ToolEventKind::Refused));
    // Parking did not run it again.
    assert_eq!(env.sim.count().await, 1);

    // A lookup that cannot be made right now (destination down) is not an
    // answer: the key stays in flight and the step is retried later.
    let c2 = ctx("section-8#2");
    tb.faults().fail_next(1, FaultMode::TimeoutAfterCommit);
    let _ = tb.call(&c2, "publish", &doc(9)).await.unwrap_err();
    let mut config = env.config();
    config.publish.url = "http://127.0.0.1:9/effects".into();
    let down = env.toolbox_with(config);
    let err = down.call(&c2, "publish", &doc(9)).await.unwrap_err();
    assert!(matches!(err, ToolError::Unreachable(_)), "{err:?}");
    assert_eq!(err.disposition(), Disposition::Retry);
    let key2 = idempotency_key("job-1", "section-8#2", "publish");
    assert_eq!(
        env.ledger
            .get("job-1", &key2)
            .await
            .unwrap()
            .unwrap()
            .0
            .state,
        EffectState::InFlight
    );
    let out = tb.call(&c2, "publish", &doc(9)).await.unwrap();
    assert_eq!(out.outcome, Outcome::Reconciled);
    assert_eq!(env.sim.count().await, 2);
}

/// A destination that refuses the connection received nothing: the key is
/// withdrawn and the retry runs normally.
#[tokio::test]
async fn unreachable_destination_leaves_no_in_flight_key() {
    let env = Env::start().await;
    let mut config = env.config();
    config.publish.url = "http://127.0.0.1:9/effects".into();
    let down = env.toolbox_with(config);
    let c = ctx("section-11#1");
    let err = down.call(&c, "publish", &doc(13)).await.unwrap_err();
    assert!(matches!(err, ToolError::Unreachable(_)), "{err:?}");
    let key = idempotency_key("job-1", "section-11#1", "publish");
    assert!(env.ledger.get("job-1", &key).await.unwrap().is_none());
    let out = env.toolbox().call(&c, "publish", &doc(13)).await.unwrap();
    assert_eq!(out.outcome, Outcome::Executed);
    assert_eq!(env.sim.count().await, 1);
}

/// The same document published by a later step is delivered once.
#[tokio::test]
async fn business_key_dedupes_the_same_document_across_steps() {
    let env = Env::start().await;
    let tb = env.toolbox();
    let first = tb
        .call(&ctx("section-9#1"), "publish", &doc(10))
        .await
        .unwrap();
    assert_eq!(first.outcome, Outcome::Executed);
    // Three steps later, the model publishes the same document (another title).
    let mut again_args = doc(10);
    again_args["title"] = json!("Report (final)");
    let again = tb
        .call(&ctx("section-9#4"), "publish", &again_args)
        .await
        .unwrap();
    assert_eq!(again.outcome, Outcome::Replayed);
    assert_eq!(again.value, first.value);
    assert_ne!(again.key, first.key);
    // And that step's own retry replays directly.
    let retry = tb
        .call(&ctx("section-9#4"), "publish", &again_args)
        .await
        .unwrap();
    assert_eq!(retry.outcome, Outcome::Replayed);
    assert_eq!(env.sim.count().await, 1);
    // Another document is another effect; so is the same one in another job.
    tb.call(&ctx("section-9#5"), "publish", &doc(11))
        .await
        .unwrap();
    tb.call(
        &CallCtx::new("job-2", "section-9#1", 1),
        "publish",
        &doc(10),
    )
    .await
    .unwrap();
    assert_eq!(env.sim.count().await, 3);
}

/// Invalid arguments come back as a validation error for the model; nothing
/// runs and nothing is recorded.
#[tokio::test]
async fn schema_invalid_arguments_are_a_validation_result() {
    let env = Env::start().await;
    let tb = env.toolbox();
    let args = json!({"title": 5, "extra": true});
    let err = tb
        .call(&ctx("section-10#1"), "publish", &args)
        .await
        .unwrap_err();
    assert!(matches!(err, ToolError::InvalidArgs { .. }), "{err:?}");
    assert_eq!(err.disposition(), Disposition::ReturnToModel);
    let result = err.to_tool_result();
    assert_eq!(result["error"]["class"], "validation");
    let msg = result["error"]["message"].as_str().unwrap();
    assert!(msg.contains("document") && msg.contains("title"), "{msg}");
    assert_eq!(env.events.kinds(), vec![ToolEventKind::Refused]);
    let key = idempotency_key("job-1", "section-10#1", "publish");
    assert!(env.ledger.get("job-1", &key).await.unwrap().is_none());
    assert_eq!(env.sim.count().await, 0);

    let err = tb
        .call(&ctx("section-10#2"), "search", &json!({"q": ""}))
        .await
        .unwrap_err();
    assert_eq!(err.class(), "validation");
    let err = tb
        .call(&ctx("section-10#3"), "nope", &json!({}))
        .await
        .unwrap_err();
    assert_eq!(err.class(), "unknown_tool");
}

/// Reads retry transient failures with backoff and report their attempts.
#[tokio::test]
async fn reads_retry_transient_failures_then_give_up() {
    let env = Env::start().await;
    let tb = env.toolbox();
    tb.faults().fail_next_for("search", 2, FaultMode::Error5xx);
    let out = tb
        .call(&ctx("s#1"), "search", &json!({"q": "lease fencing"}))
        .await
        .unwrap();
    assert_eq!(out.attempts, 3);
    assert_eq!(out.outcome, Outcome::Executed);
    let results = out.value["results"].as_array().unwrap();
    assert!(!results.is_empty());
    assert!(results[0]["url"]
        .as_str()
        .unwrap()
        .starts_with(&env.sim.base));

    tb.faults().fail_next_for("search", 3, FaultMode::Error5xx);
    let err = tb
        .call(&ctx("s#2"), "search", &json!({"q": "x"}))
        .await
        .unwrap_err();
    assert!(
        matches!(err, ToolError::Upstream { status: 503, .. }),
        "{err:?}"
    );
    // A non-retryable error is not retried.
    tb.faults()
        .fail_next_for("search", 1, FaultMode::TimeoutBeforeCommit);
    let out = tb
        .call(&ctx("s#3"), "search", &json!({"q": "x"}))
        .await
        .unwrap();
    assert_eq!(out.attempts, 2, "timeouts of reads are retryable");
    let kinds = env.events.kinds();
    assert_eq!(
        kinds
            .iter()
            .filter(|k| **k == ToolEventKind::Started)
            .count(),
        3
    );
}

/// Writes without a ledger refuse to run.
#[tokio::test]
async fn writes_without_a_ledger_refuse() {
    let env = Env::start().await;
    let tb = Toolbox::builtin(&env.config(), None, env.events.clone()).unwrap();
    let err = tb.call(&ctx("s#1"), "publish", &doc(12)).await.unwrap_err();
    assert_eq!(err.class(), "config");
    assert_eq!(env.sim.count().await, 0);
}

/// The sink's own behaviour the tools rely on: dedupe by key, every keyless
/// POST an effect, and `commit_twice` doubling a keyless one.
#[tokio::test]
async fn effects_sink_dedupes_by_key_only() {
    let env = Env::start().await;
    let http = reqwest::Client::new();
    let url = format!("{}/effects", env.sim.base);
    let a = http
        .post(&url)
        .header("Idempotency-Key", "k1")
        .json(&json!({"n": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(a.status(), 201);
    let a: Value = a.json().await.unwrap();
    let b = http
        .post(&url)
        .header("Idempotency-Key", "k1")
        .json(&json!({"n": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(b.status(), 200);
    assert_eq!(b.json::<Value>().await.unwrap(), a);
    http.post(&url).json(&json!({"n": 3})).send().await.unwrap();
    http.post(&url).json(&json!({"n": 3})).send().await.unwrap();
    assert_eq!(env.sim.count().await, 3);
    http.post(&url)
        .header("x-sim-effects-fault", "commit_twice")
        .json(&json!({"n": 4}))
        .send()
        .await
        .unwrap();
    assert_eq!(env.sim.count().await, 5);
    let all: Value = http.get(&url).send().await.unwrap().json().await.unwrap();
    assert_eq!(all.as_array().unwrap().len(), 5);
    assert_eq!(all[0]["key"], "k1");
    assert_eq!(all[0]["body"], json!({"n": 1}));
    assert_eq!(env.sim.effect("k1").await.unwrap(), a);
    assert!(env.sim.effect("nope").await.is_none());
}

/// A business key left by a step that stopped before recording `in_flight`
/// (so it never ran) is taken over; that step's key is retired so it can
/// never run later.
#[tokio::test]
async fn a_business_key_whose_owner_never_ran_is_taken_over() {
    let env = Env::start().await;
    let tb = env.toolbox();
    let args = doc(14);
    let tool = tb.tool("publish").unwrap();
    let bk = tool.business_key("job-1", &args).unwrap();
    let stale_key = "f".repeat(64);
    let owner = json!({"effect_key": stale_key, "tool": "publish", "job_id": "job-1", "at": "2026-11-30T00:00:00Z"});
    env.ledger
        .store()
        .put(
            leasehold_tools::business_key_id("publish", &bk),
            serde_json::to_vec(&owner).unwrap().into(),
        )
        .await
        .unwrap();
    let out = tb
        .call(&ctx("section-12#2"), "publish", &args)
        .await
        .unwrap();
    assert_eq!(out.outcome, Outcome::Executed);
    assert_eq!(
        env.ledger
            .get("job-1", &stale_key)
            .await
            .unwrap()
            .unwrap()
            .0
            .state,
        EffectState::Void
    );
    assert_eq!(env.sim.count().await, 1);
}

/// After a reclaim, the stale owner (older epoch) may not touch a key the new
/// owner holds in flight; the new owner reconciles it.
#[tokio::test]
async fn a_stale_epoch_cannot_take_over_a_newer_in_flight_key() {
    let env = Env::start().await;
    let tb = env.toolbox();
    let args = doc(15);
    tb.faults().fail_next(1, FaultMode::TimeoutAfterCommit);
    let newer = CallCtx::new("job-1", "section-13#1", 5);
    assert!(matches!(
        tb.call(&newer, "publish", &args).await,
        Err(ToolError::Timeout(_))
    ));
    let stale = CallCtx::new("job-1", "section-13#1", 4);
    let err = tb.call(&stale, "publish", &args).await.unwrap_err();
    assert!(matches!(err, ToolError::Superseded { .. }), "{err:?}");
    assert_eq!(err.disposition(), Disposition::Fail);
    let out = tb
        .call(&CallCtx::new("job-1", "section-13#1", 6), "publish", &args)
        .await
        .unwrap();
    assert_eq!(out.outcome, Outcome::Reconciled);
    // Once done, any epoch gets the stored result.
    assert_eq!(
        tb.call(&stale, "publish", &args).await.unwrap().outcome,
        Outcome::Replayed
    );
    assert_eq!(env.sim.count().await, 1);
}

/// A guard that refuses: the caller lost the job to a newer owner.
struct Refuse;

impl EffectGuard for Refuse {
    fn prove(&self) -> BoxFuture<'_, Result<(), ToolError>> {
        Box::pin(async { Err(ToolError::OwnershipLost("job is running at epoch 2".into())) })
    }
}

/// A write whose guard refuses ownership stops before its effect: nothing
/// is sent, nothing is recorded, and the next owner runs it.
#[tokio::test]
async fn a_refused_ownership_proof_stops_the_write_before_its_effect() {
    let env = Env::start().await;
    let tb = env.toolbox();
    let stale = CallCtx::new("job-1", "publish#0", 1).guarded(Arc::new(Refuse));
    let err = tb.call(&stale, "publish", &doc(16)).await.unwrap_err();
    assert!(matches!(err, ToolError::OwnershipLost(_)), "{err:?}");
    assert_eq!(err.disposition(), Disposition::Stop);
    assert_eq!(env.sim.count().await, 0, "nothing sent");
    assert!(!env.events.kinds().contains(&ToolEventKind::Started));
    let key = idempotency_key("job-1", "publish#0", "publish");
    assert!(env.ledger.get("job-1", &key).await.unwrap().is_none());
    let out = tb
        .call(&CallCtx::new("job-1", "publish#0", 2), "publish", &doc(16))
        .await
        .unwrap();
    assert_eq!(out.outcome, Outcome::Executed);
    assert_eq!(env.sim.count().await, 1);
}

/// nats-server honours `Nats-TTL: never` over the stream's `max_age`: the
/// ledger's entries outlive the bucket's retention, an entry written
/// without it does not.
#[tokio::test]
async fn ledger_entries_outlive_the_buckets_retention() {
    let env = Env::start().await;
    let kv = env
        .js
        .create_key_value(leasehold_store::setup::effects_config(
            "lh_effects_short".into(),
            Duration::from_secs(1),
            1,
        ))
        .await
        .unwrap();
    let ledger = leasehold_tools::EffectsLedger::new(env.js.clone(), kv.clone());
    let tb = Toolbox::builtin(&env.config(), Some(ledger.clone()), env.events.clone()).unwrap();
    let c = ctx("publish#0");
    let first = tb.call(&c, "publish", &doc(17)).await.unwrap();
    kv.put("probe", "plain".into()).await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while kv.get("probe").await.unwrap().is_some() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "max_age never expired the probe"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (entry, _) = ledger.get("job-1", &first.key).await.unwrap().unwrap();
    assert_eq!(entry.state, EffectState::Done);
    let again = tb.call(&c, "publish", &doc(17)).await.unwrap();
    assert_eq!(again.outcome, Outcome::Replayed);
    assert_eq!(env.sim.count().await, 1);
}

/// `purge_job` removes one job's entries and the business keys its effects
/// own, and nothing of any other job.
#[tokio::test]
async fn purging_a_job_removes_its_entries_and_its_business_keys_only() {
    let env = Env::start().await;
    let tb = env.toolbox();
    let publish = tb.tool("publish").unwrap().clone();
    // Job "bk": a job id that looks like the old business-key prefix.
    for job in ["job-a", "job-b", "bk"] {
        for step in ["s#1", "s#2"] {
            tb.call(
                &CallCtx::new(job, step, 1),
                "publish",
                &doc(step.len() as u32 + job.len() as u32),
            )
            .await
            .unwrap();
        }
    }
    let bk_of = |job: &str| {
        leasehold_tools::business_key_id(
            "publish",
            &publish
                .business_key(job, &doc(3 + job.len() as u32))
                .unwrap(),
        )
    };
    for job in ["job-a", "job-b", "bk"] {
        assert!(env.ledger.store().get(bk_of(job)).await.unwrap().is_some());
    }
    let purged = env.ledger.purge_job("job-a").await.unwrap();
    assert_eq!(purged.entries, 2);
    // Both steps published the same document: one business key, owned by s#1.
    assert_eq!(purged.business_keys, 1);
    assert!(env
        .ledger
        .store()
        .get(bk_of("job-a"))
        .await
        .unwrap()
        .is_none());
    for step in ["s#1", "s#2"] {
        let a = idempotency_key("job-a", step, "publish");
        assert!(env.ledger.get("job-a", &a).await.unwrap().is_none());
        let b = idempotency_key("job-b", step, "publish");
        assert!(env.ledger.get("job-b", &b).await.unwrap().is_some());
    }
    env.ledger.purge_job("bk").await.unwrap();
    assert!(env
        .ledger
        .store()
        .get(bk_of("job-b"))
        .await
        .unwrap()
        .is_some());
    // Idempotent, and a bad job id is refused rather than matching others.
    assert_eq!(env.ledger.purge_job("job-a").await.unwrap().entries, 0);
    assert!(env.ledger.purge_job("job-*").await.is_err());
    assert!(env.ledger.purge_job("a.b").await.is_err());
}
