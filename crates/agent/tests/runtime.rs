//! The generation retry loop, restart eligibility, the circuit breaker,
//! budgets, and the section runner's warm and cold retries, against a real
//! socket.

// The model crate's test server and helpers, shared, not copied.
#[path = "../../model/tests/common/mod.rs"]
mod common;

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use leasehold_agent::{
    RetryMode, SectionInput, SectionOutcome, SectionPolicy, SectionRunner, ToolExecutor,
    ToolOutcome, TranscriptHook,
};
use leasehold_model::{
    BreakerConfig, BreakerState, Budget, BudgetKind, BudgetLimits, ChatRequest, CircuitBreaker,
    CollectingReporter, FailureClass, GenerationPolicy, Generator, Ineligible, ModelClient,
    ModelConfig, ModelError, Price, PriceTable, RetryReport, RetryReporter, RetryScope, RunContext,
};
use leasehold_transcript::{Message, Thread};
use serde_json::{json, Value};

fn fast_policy(max_attempts: u32) -> GenerationPolicy {
    GenerationPolicy {
        max_attempts,
        base: Duration::from_millis(1),
        cap: Duration::from_millis(5),
        max_server_delay: Duration::from_secs(120),
    }
}

fn generator(client: ModelClient, max_attempts: u32) -> Generator {
    Generator::new(
        client,
        fast_policy(max_attempts),
        BreakerConfig {
            min_calls: 1000,
            ..Default::default()
        },
    )
}

fn req() -> ChatRequest {
    ChatRequest {
        messages: vec![Message::user("hi")],
        ..Default::default()
    }
}

fn ctx() -> (RunContext, Arc<CollectingReporter>) {
    let mut c = RunContext::new(Budget::unlimited());
    let rep = Arc::new(CollectingReporter::default());
    c.reporter = rep.clone();
    (c, rep)
}

#[tokio::test]
async fn generation_retry_recovers_from_incomplete_stream() {
    let s = serve(|i, _| if i == 0 { sse(&[]) } else { answer("fine") }).await;
    let g = generator(s.client(), 3);
    let (ctx, rep) = ctx();
    let mut reports = vec![];
    let out = g.generate(&req(), &ctx, &mut reports).await.unwrap();
    assert_eq!(out.completion.content, "fine");
    assert_eq!(out.attempts, 2);
    let r = rep.take();
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].scope, RetryScope::Generation);
    assert!(r[0].eligible);
    assert_eq!(r[0].attempt, 2);
    assert_eq!(r[0].class, Some(FailureClass::IncompleteGeneration));
    assert_eq!(reports, r);
    // The report serializes with the contract's field names.
    let v = serde_json::to_value(&r[0]).unwrap();
    for k in [
        "scope",
        "reason",
        "eligible",
        "retained",
        "attempt",
        "budget_left",
    ] {
        assert!(v.get(k).is_some(), "{k}");
    }
    assert_eq!(v["scope"], "generation");
}

#[tokio::test]
async fn rate_limit_retry_after_is_honoured() {
    let s = serve(|i, _| {
        if i == 0 {
            status(
                429,
                &[("retry-after-ms", "150")],
                json!({"error":{"message":"slow"}}),
            )
        } else {
            answer("ok")
        }
    })
    .await;
    let g = generator(s.client(), 3);
    let (ctx, rep) = ctx();
    let t = std::time::Instant::now();
    g.generate(&req(), &ctx, &mut vec![]).await.unwrap();
    assert!(t.elapsed() >= Duration::from_millis(150));
    assert!(rep.take()[0].delay_ms.unwrap() >= 150);
}

#[tokio::test]
async fn eligibility_refuses_after_visible_output() {
    let s = serve(|_, _| sse(&[content("Visible text")])).await;
    let g = generator(s.client(), 3);
    let (mut ctx, rep) = ctx();
    let seen = Arc::new(Mutex::new(String::new()));
    let seen2 = seen.clone();
    ctx.watcher = Some(Arc::new(move |t: &str| seen2.lock().unwrap().push_str(t)));
    let f = g.generate(&req(), &ctx, &mut vec![]).await.unwrap_err();
    assert_eq!(f.ineligible, Some(Ineligible::VisibleOutput));
    assert_eq!(s.hits(), 1);
    assert_eq!(*seen.lock().unwrap(), "Visible text");
    assert!(!rep.take()[0].eligible);
}

#[tokio::test]
async fn eligibility_refuses_after_completion() {
    // The finish signal arrived; then the connection broke before [DONE].
    let s = serve(|_, _| {
        vec![
            Step::Write(
                format!("{SSE_HEAD}{}{}", content("done text"), finish("stop")).into_bytes(),
            ),
            Step::Pause(Duration::from_millis(20)),
            Step::Reset,
        ]
    })
    .await;
    let mut cfg = s.config();
    cfg.quirks.require_done = true;
    let g = generator(ModelClient::new(cfg).unwrap(), 3);
    let (ctx, _) = ctx();
    let f = g.generate(&req(), &ctx, &mut vec![]).await.unwrap_err();
    assert_eq!(f.ineligible, Some(Ineligible::Completed), "{:?}", f.error);
    assert_eq!(s.hits(), 1);
}

#[tokio::test]
async fn eligibility_refuses_after_unknown_event() {
    let s =
        serve(|_, _| sse(&["event: response.web_search_call.in_progress\ndata: {}\n\n".into()]))
            .await;
    let g = generator(s.client(), 3);
    let (ctx, _) = ctx();
    let f = g.generate(&req(), &ctx, &mut vec![]).await.unwrap_err();
    assert_eq!(f.ineligible, Some(Ineligible::UnknownEvent));
    assert_eq!(s.hits(), 1);
}

/// Cancels the run when the first retry is reported, i.e. during backoff.
struct CancelOnReport(tokio_util::sync::CancellationToken);
impl RetryReporter for CancelOnReport {
    fn report(&self, _r: RetryReport) {
        self.0.cancel();
    }
}

#[tokio::test]
async fn cancellation_interrupts_backoff_and_refuses_retry() {
    let s = serve(|_, _| {
        status(
            503,
            &[("Retry-After", "60")],
            json!({"error":{"message":"overloaded"}}),
        )
    })
    .await;
    let g = generator(s.client(), 5);
    let (mut ctx, _) = ctx();
    ctx.reporter = Arc::new(CancelOnReport(ctx.cancel.clone()));
    let t = std::time::Instant::now();
    let f = g.generate(&req(), &ctx, &mut vec![]).await.unwrap_err();
    assert!(matches!(f.error, ModelError::Cancelled));
    assert!(t.elapsed() < Duration::from_secs(5));
    assert_eq!(s.hits(), 1);
    // A cancelled run is not eligible either.
    assert_eq!(
        leasehold_model::eligibility(&Default::default(), true),
        Err(Ineligible::Cancelled)
    );
}

#[tokio::test]
async fn deadline_bounds_the_backoff() {
    let s = serve(|_, _| {
        status(
            503,
            &[("Retry-After", "30")],
            json!({"error":{"message":"overloaded"}}),
        )
    })
    .await;
    let g = generator(s.client(), 5);
    let (mut ctx, rep) = ctx();
    ctx.deadline = Some(tokio::time::Instant::now() + Duration::from_secs(2));
    let t = std::time::Instant::now();
    let f = g.generate(&req(), &ctx, &mut vec![]).await.unwrap_err();
    assert!(matches!(f.error, ModelError::Deadline));
    assert!(t.elapsed() < Duration::from_secs(2));
    assert!(!rep.take()[0].eligible);
}

#[tokio::test]
async fn fallback_model_is_used_and_recorded() {
    let s = serve(|_, body: &Value| {
        if body["model"] == "backup" {
            answer("from backup")
        } else {
            status(503, &[], json!({"error":{"message":"down"}}))
        }
    })
    .await;
    let cfg = ModelConfig {
        fallback_model: Some("backup".into()),
        ..s.config()
    };
    let g = generator(ModelClient::new(cfg).unwrap(), 2);
    let (ctx, rep) = ctx();
    let out = g.generate(&req(), &ctx, &mut vec![]).await.unwrap();
    assert_eq!(out.fallback_used.as_deref(), Some("backup"));
    assert_eq!(out.completion.content, "from backup");
    assert!(rep
        .take()
        .iter()
        .any(|r| r.fallback_model.as_deref() == Some("backup")));
}

#[tokio::test(start_paused = true)]
async fn circuit_breaker_transitions() {
    let cfg = BreakerConfig {
        window: Duration::from_secs(10),
        min_calls: 4,
        failure_rate: 0.5,
        cool_down: Duration::from_secs(5),
    };
    let b = CircuitBreaker::new("model", cfg);
    assert_eq!(b.state(), BreakerState::Closed);
    for ok in [true, false, true] {
        b.try_acquire().unwrap();
        b.record(ok);
    }
    assert_eq!(b.state(), BreakerState::Closed, "below min_calls");
    b.try_acquire().unwrap();
    b.record(false);
    assert_eq!(b.state(), BreakerState::Open);
    let ra = b.try_acquire().unwrap_err();
    assert_eq!(ra, Duration::from_secs(5));
    tokio::time::advance(Duration::from_secs(2)).await;
    assert_eq!(b.try_acquire().unwrap_err(), Duration::from_secs(3));
    tokio::time::advance(Duration::from_secs(3)).await;
    b.try_acquire().unwrap(); // the probe
    assert_eq!(b.state(), BreakerState::HalfOpen);
    assert!(b.try_acquire().is_err(), "one probe at a time");
    b.record(false);
    assert_eq!(b.state(), BreakerState::Open);
    tokio::time::advance(Duration::from_secs(5)).await;
    b.try_acquire().unwrap();
    b.record(true);
    assert_eq!(b.state(), BreakerState::Closed);
    // Old failures fall out of the window.
    for _ in 0..3 {
        b.try_acquire().unwrap();
        b.record(false);
    }
    tokio::time::advance(Duration::from_secs(11)).await;
    b.try_acquire().unwrap();
    b.record(false);
    assert_eq!(b.state(), BreakerState::Closed);
}

#[tokio::test]
async fn open_breaker_fails_fast_with_cool_down() {
    let s = serve(|_, _| status(500, &[], json!({"error":{"message":"boom"}}))).await;
    let g = Generator::new(
        s.client(),
        fast_policy(1),
        BreakerConfig {
            min_calls: 2,
            failure_rate: 0.5,
            cool_down: Duration::from_secs(30),
            ..Default::default()
        },
    );
    let (ctx, _) = ctx();
    // Two distinct requests failing: a storm, not one request that keeps failing.
    for i in 0..2 {
        let r = ChatRequest {
            messages: vec![Message::user(format!("hi {i}"))],
            ..Default::default()
        };
        assert_eq!(
            g.generate(&r, &ctx, &mut vec![])
                .await
                .unwrap_err()
                .error
                .class(),
            FailureClass::ServerError
        );
    }
    assert_eq!(g.breaker.state(), BreakerState::Open);
    let f = g.generate(&req(), &ctx, &mut vec![]).await.unwrap_err();
    assert_eq!(f.error.class(), FailureClass::CircuitOpen);
    // The error names the cause that opened the breaker first.
    assert!(
        f.error.to_string().starts_with("server_error: HTTP 500"),
        "{}",
        f.error
    );
    assert!(f.error.retry_after().unwrap() > Duration::from_secs(25));
    assert_eq!(s.hits(), 2, "no request while open");
}

// ---- section runner ----

/// Records every tool call; `search` returns a result with a URL.
#[derive(Default)]
struct Tools {
    calls: Mutex<Vec<(String, String)>>,
}

impl ToolExecutor for Tools {
    fn specs(&self) -> Vec<Value> {
        vec![leasehold_model::function_tool(
            "search",
            "search the web",
            json!({"type":"object","properties":{"query":{"type":"string"}}}),
        )]
    }
    fn call<'a>(
        &'a self,
        name: &'a str,
        args: &'a Value,
        _id: &'a str,
    ) -> Pin<Box<dyn Future<Output = ToolOutcome> + Send + 'a>> {
        Box::pin(async move {
            self.calls
                .lock()
                .unwrap()
                .push((name.to_string(), args.to_string()));
            ToolOutcome::Ok(format!("{name} ok"))
        })
    }
}

impl Tools {
    fn count(&self) -> usize {
        self.calls.lock().unwrap().len()
    }
}

/// A scripted agent: search, then fetch, then the answer. `fault` decides
/// per request index whether to cut the stream instead.
fn agent_server(
    fault: impl Fn(usize, usize) -> bool + Send + Sync + 'static,
) -> impl Fn(usize, &Value) -> Vec<Step> + Send + Sync + 'static {
    move |i, body| {
        let n = tool_results(body);
        if fault(i, n) {
            return sse(&[content("The rel")]); // cut before the finish signal
        }
        match n {
            0 => propose(&format!("call_s{i}"), "search", r#"{"query":"leases"}"#),
            1 => propose(
                &format!("call_f{i}"),
                "fetch",
                r#"{"url":"http://x/page/a"}"#,
            ),
            _ => answer("## Reliability\nLeases fence stale owners."),
        }
    }
}

fn runner(client: ModelClient, tools: Arc<Tools>, mode: RetryMode) -> SectionRunner {
    let mut r = SectionRunner::new(Arc::new(generator(client, 1)), tools);
    r.policy = SectionPolicy {
        mode,
        ..Default::default()
    };
    r
}

fn input() -> SectionInput {
    SectionInput {
        system: "You are a research agent.".into(),
        section_prompt: "Write the reliability section.".into(),
        rolling_context: "Intro: done.".into(),
        initial: None,
    }
}

#[tokio::test]
async fn section_completes_with_tool_loop_and_hook() {
    struct Hook(Mutex<Vec<String>>);
    impl TranscriptHook for Hook {
        fn on_message(&self, g: u32, m: &Message) {
            self.0.lock().unwrap().push(format!("{g}:{}", m.role()));
        }
    }
    let s = serve(agent_server(|_, _| false)).await;
    let tools = Arc::new(Tools::default());
    let hook = Arc::new(Hook(Mutex::new(vec![])));
    let mut r = runner(s.client(), tools.clone(), RetryMode::WarmThenCold);
    r.hook = hook.clone();
    let (ctx, _) = ctx();
    let res = r.run(input(), &ctx).await;
    assert!(matches!(&res.outcome, SectionOutcome::Completed { text } if text.contains("Leases")));
    assert_eq!(tools.count(), 2);
    assert_eq!(
        *hook.0.lock().unwrap(),
        vec![
            "0:assistant",
            "0:tool",
            "0:assistant",
            "0:tool",
            "0:assistant"
        ]
    );
    // Tools are offered on every request.
    assert!(s.requests.lock().unwrap()[0]["tools"].is_array());
}

#[tokio::test]
async fn each_model_call_is_reported_once_with_its_usage_and_duration() {
    struct Calls(Mutex<Vec<leasehold_agent::ModelCall>>);
    impl TranscriptHook for Calls {
        fn on_message(&self, _: u32, _: &Message) {}
        fn on_model_call(&self, c: &leasehold_agent::ModelCall) {
            self.0.lock().unwrap().push(c.clone());
        }
    }
    let s = serve(agent_server(|_, _| false)).await;
    let hook = Arc::new(Calls(Mutex::new(vec![])));
    let mut r = runner(
        s.client(),
        Arc::new(Tools::default()),
        RetryMode::WarmThenCold,
    );
    r.hook = hook.clone();
    let (ctx, _) = ctx();
    let res = r.run(input(), &ctx).await;
    assert!(matches!(res.outcome, SectionOutcome::Completed { .. }));
    let calls = hook.0.lock().unwrap().clone();
    // Two proposals of a tool, then the answer: three calls, one report each.
    assert_eq!(calls.len() as u32, res.model_calls);
    let outcomes: Vec<&str> = calls.iter().map(|c| c.outcome.as_str()).collect();
    assert_eq!(outcomes, ["tool_calls", "tool_calls", "ok"]);
    for c in &calls {
        assert!(c.tokens_in > 0 && c.tokens_out > 0, "{c:?}");
        assert_eq!(c.attempts, 1);
        assert!(!c.model.is_empty());
    }
    let tagged = calls[2].tagged(json!({"step": "s#0"}));
    assert_eq!(tagged["step"], "s#0");
    assert_eq!(tagged["outcome"], "ok");
    assert!(tagged["duration_ms"].is_u64());
}

#[tokio::test]
async fn warm_retry_avoids_the_tool_calls_a_naive_retry_repeats() {
    // The stream is cut the first time the model writes the section after
    // both tools ran.
    let fault = || {
        let fired = Arc::new(AtomicUsize::new(0));
        move |_i: usize, n: usize| n == 2 && fired.fetch_add(1, Ordering::SeqCst) == 0
    };
    let s = serve(agent_server(fault())).await;
    let tools = Arc::new(Tools::default());
    let (ctx, _) = ctx();
    let warm = runner(s.client(), tools.clone(), RetryMode::WarmThenCold)
        .run(input(), &ctx)
        .await;
    assert!(
        matches!(warm.outcome, SectionOutcome::Completed { .. }),
        "{:?}",
        warm.outcome
    );
    assert_eq!(tools.count(), 2, "warm retry reuses the recorded results");
    assert_eq!(
        warm.reports
            .iter()
            .filter(|r| r.scope == RetryScope::Warm)
            .count(),
        1
    );
    assert!(warm.reports.iter().any(|r| r.scope == RetryScope::Warm
        && r.retained.contains("2 complete tool-call groups reused")));
    // The prompt was not appended again.
    let prompts = warm
        .thread
        .messages
        .iter()
        .filter(|m| **m == Message::user("Write the reliability section."))
        .count();
    assert_eq!(prompts, 1);

    let s = serve(agent_server(fault())).await;
    let tools = Arc::new(Tools::default());
    let naive = runner(s.client(), tools.clone(), RetryMode::NaiveWholeTurn)
        .run(input(), &ctx)
        .await;
    assert!(matches!(naive.outcome, SectionOutcome::Completed { .. }));
    assert_eq!(
        tools.count(),
        4,
        "naive whole-turn retry repeats search and fetch"
    );
}

#[tokio::test]
async fn failure_outlasting_every_budget_ends_skipped_with_reports() {
    let s = serve(|_, _| status(503, &[], json!({"error":{"message":"overloaded"}}))).await;
    let tools = Arc::new(Tools::default());
    let mut r = SectionRunner::new(Arc::new(generator(s.client(), 2)), tools);
    r.policy = SectionPolicy::default();
    let (ctx, rep) = ctx();
    let res = r.run(input(), &ctx).await;
    match &res.outcome {
        SectionOutcome::Skipped { reason } => assert!(reason.contains("overloaded"), "{reason}"),
        other => panic!("{other:?}"),
    }
    // 1 initial + 2 warm + 2 cold attempts, 2 generations each.
    assert_eq!(s.hits(), 10);
    let scopes: Vec<_> = res.reports.iter().map(|r| (r.scope, r.eligible)).collect();
    assert_eq!(
        scopes
            .iter()
            .filter(|s| **s == (RetryScope::Warm, true))
            .count(),
        2
    );
    assert_eq!(
        scopes
            .iter()
            .filter(|s| **s == (RetryScope::Cold, true))
            .count(),
        2
    );
    assert_eq!(scopes.last(), Some(&(RetryScope::Cold, false)));
    assert_eq!(rep.take().len(), res.reports.len());
    assert_eq!(res.thread.generation, 2);
}

#[tokio::test]
async fn tool_failure_is_retried_warm_without_replaying_completed_calls() {
    struct Flaky {
        calls: Mutex<Vec<String>>,
    }
    impl ToolExecutor for Flaky {
        fn specs(&self) -> Vec<Value> {
            vec![]
        }
        fn call<'a>(
            &'a self,
            name: &'a str,
            _a: &'a Value,
            _id: &'a str,
        ) -> Pin<Box<dyn Future<Output = ToolOutcome> + Send + 'a>> {
            Box::pin(async move {
                let mut c = self.calls.lock().unwrap();
                c.push(name.to_string());
                if name == "fetch" && c.iter().filter(|n| *n == "fetch").count() == 1 {
                    ToolOutcome::Failed("timeout".into())
                } else {
                    ToolOutcome::Ok("ok".into())
                }
            })
        }
    }
    let s = serve(agent_server(|_, _| false)).await;
    let tools = Arc::new(Flaky {
        calls: Mutex::new(vec![]),
    });
    let r = SectionRunner::new(Arc::new(generator(s.client(), 1)), tools.clone());
    let (ctx, _) = ctx();
    let res = r.run(input(), &ctx).await;
    assert!(
        matches!(res.outcome, SectionOutcome::Completed { .. }),
        "{:?}",
        res.outcome
    );
    assert_eq!(
        *tools.calls.lock().unwrap(),
        vec!["search", "fetch", "fetch"]
    );
}

#[tokio::test]
async fn resume_from_initial_transcript_continues_without_replaying() {
    let s = serve(agent_server(|_, _| false)).await;
    let tools = Arc::new(Tools::default());
    let r = runner(s.client(), tools.clone(), RetryMode::WarmThenCold);
    let mut inp = input();
    let mut msgs = leasehold_transcript::build_messages(
        &inp.system,
        &inp.rolling_context,
        &inp.section_prompt,
    );
    msgs.push(Message::assistant_calls(vec![
        leasehold_transcript::ToolCall::new("c1", "search", r#"{"query":"leases"}"#),
    ]));
    msgs.push(Message::tool("c1", r#"{"results":[]}"#));
    // A proposal recorded whose result never was: dropped, then re-proposed.
    msgs.push(Message::assistant_calls(vec![
        leasehold_transcript::ToolCall::new("c2", "fetch", r#"{"url":"u"}"#),
    ]));
    inp.initial = Some(Thread {
        generation: 0,
        messages: msgs,
    });
    let (ctx, _) = ctx();
    let res = r.run(inp, &ctx).await;
    assert!(matches!(res.outcome, SectionOutcome::Completed { .. }));
    assert_eq!(
        *tools
            .calls
            .lock()
            .unwrap()
            .iter()
            .map(|c| c.0.as_str())
            .collect::<Vec<_>>(),
        ["fetch"]
    );
}

#[tokio::test]
async fn loop_is_stopped_and_parked() {
    let s =
        serve(|i, _| propose(&format!("c{i}"), "search", r#"{"query":"same", "page": 1}"#)).await;
    let tools = Arc::new(Tools::default());
    let r = runner(s.client(), tools.clone(), RetryMode::WarmThenCold);
    let (ctx, _) = ctx();
    let res = r.run(input(), &ctx).await;
    assert!(
        matches!(
            res.outcome,
            SectionOutcome::Parked {
                class: FailureClass::Loop,
                ..
            }
        ),
        "{:?}",
        res.outcome
    );
    assert_eq!(tools.count(), 2);
}

#[tokio::test]
async fn refusal_parks_and_auth_fails() {
    let s = serve(|_, _| {
        sse(&[
            data(json!({"choices":[{"index":0,"delta":{"refusal":"no"},"finish_reason":null}]})),
            finish("stop"),
            done(),
        ])
    })
    .await;
    let (ctx, _) = ctx();
    let res = runner(
        s.client(),
        Arc::new(Tools::default()),
        RetryMode::WarmThenCold,
    )
    .run(input(), &ctx)
    .await;
    assert!(matches!(
        res.outcome,
        SectionOutcome::Parked {
            class: FailureClass::Refusal,
            ..
        }
    ));
    assert_eq!(s.hits(), 1, "a refusal is never rephrased or retried");
    let s = serve(|_, _| status(401, &[], json!({"error":{"message":"bad key"}}))).await;
    let res = runner(
        s.client(),
        Arc::new(Tools::default()),
        RetryMode::WarmThenCold,
    )
    .run(input(), &ctx)
    .await;
    assert!(matches!(
        res.outcome,
        SectionOutcome::Failed {
            class: FailureClass::Auth,
            ..
        }
    ));
    assert_eq!(s.hits(), 1);
}

#[tokio::test]
async fn malformed_structured_output_is_re_asked_once() {
    let s = serve(|i, _| {
        if i == 0 {
            answer("not json")
        } else {
            answer(r#"{"title":"T"}"#)
        }
    })
    .await;
    let mut r = runner(
        s.client(),
        Arc::new(Tools::default()),
        RetryMode::WarmThenCold,
    );
    r.policy.response_format = Some(
        json!({"type":"json_schema","json_schema":{"name":"o","schema":{"type":"object","required":["title"]}}}),
    );
    let (ctx, _) = ctx();
    let res = r.run(input(), &ctx).await;
    assert!(matches!(&res.outcome, SectionOutcome::Completed { text } if text.contains("title")));
    let second = &s.requests.lock().unwrap()[1];
    let last = second["messages"]
        .as_array()
        .unwrap()
        .last()
        .unwrap()
        .clone();
    assert!(last["content"]
        .as_str()
        .unwrap()
        .contains("failed validation"));
}

#[tokio::test]
async fn context_exceeded_is_repaired_warm_with_compaction() {
    let s = serve(|_, body: &Value| {
        let size = body["messages"].to_string().len();
        if size > 3000 {
            return status(400, &[], json!({"error":{"message":"This model's maximum context length is 100 tokens","code":"context_length_exceeded"}}));
        }
        match tool_results(body) {
            0 => propose("s", "search", r#"{"query":"q"}"#),
            1 => propose("f", "fetch", r#"{"url":"u"}"#),
            _ => answer("done"),
        }
    })
    .await;
    struct Big;
    impl ToolExecutor for Big {
        fn specs(&self) -> Vec<Value> {
            vec![]
        }
        fn call<'a>(
            &'a self,
            _n: &'a str,
            _a: &'a Value,
            _id: &'a str,
        ) -> Pin<Box<dyn Future<Output = ToolOutcome> + Send + 'a>> {
            Box::pin(async { ToolOutcome::Ok("x".repeat(2000)) })
        }
    }
    let mut r = SectionRunner::new(Arc::new(generator(s.client(), 1)), Arc::new(Big));
    r.policy.compaction = leasehold_transcript::CompactionPolicy {
        max_chars: 2000,
        keep_recent_groups: 1,
        truncate_to: 100,
    };
    let (ctx, _) = ctx();
    let res = r.run(input(), &ctx).await;
    assert!(
        matches!(res.outcome, SectionOutcome::Completed { .. }),
        "{:?}",
        res.outcome
    );
    assert!(res
        .reports
        .iter()
        .any(|r| r.scope == RetryScope::Warm && r.retained.contains("compacted")));
}

async fn budget_run(limits: BudgetLimits, prices: PriceTable) -> SectionOutcome {
    let s = serve(agent_server(|_, _| false)).await;
    let r = runner(
        s.client(),
        Arc::new(Tools::default()),
        RetryMode::WarmThenCold,
    );
    let (mut ctx, _) = ctx();
    ctx.budget = Arc::new(Mutex::new(Budget::new(limits, prices)));
    r.run(input(), &ctx).await.outcome
}

#[tokio::test]
async fn budget_exhaustion_for_each_kind() {
    let out = budget_run(
        BudgetLimits {
            max_steps: Some(2),
            ..Default::default()
        },
        PriceTable::default(),
    )
    .await;
    assert_eq!(
        out,
        SectionOutcome::BudgetExhausted {
            kind: BudgetKind::Steps
        }
    );
    // Each response uses 15 tokens.
    let out = budget_run(
        BudgetLimits {
            max_tokens: Some(20),
            ..Default::default()
        },
        PriceTable::default(),
    )
    .await;
    assert_eq!(
        out,
        SectionOutcome::BudgetExhausted {
            kind: BudgetKind::Tokens
        }
    );
    let prices = PriceTable(
        [(
            "test-model".to_string(),
            Price {
                input_per_mtok: 1e6,
                output_per_mtok: 1e6,
            },
        )]
        .into_iter()
        .collect(),
    );
    let out = budget_run(
        BudgetLimits {
            max_cost_usd: Some(20.0),
            ..Default::default()
        },
        prices,
    )
    .await;
    assert_eq!(
        out,
        SectionOutcome::BudgetExhausted {
            kind: BudgetKind::Cost
        }
    );
    let out = budget_run(
        BudgetLimits {
            max_wall: Some(Duration::ZERO),
            ..Default::default()
        },
        PriceTable::default(),
    )
    .await;
    assert_eq!(
        out,
        SectionOutcome::BudgetExhausted {
            kind: BudgetKind::WallTime
        }
    );
}

#[tokio::test]
async fn invalid_tool_arguments_go_back_to_the_model() {
    let s = serve(|_, body: &Value| {
        let msgs = body["messages"].as_array().unwrap();
        match msgs.iter().rev().find(|m| m["role"] == "tool") {
            None => propose("bad", "search", "{\"query\": \"unterminated"),
            Some(t) => answer(&format!("saw: {}", t["content"].as_str().unwrap())),
        }
    })
    .await;
    let tools = Arc::new(Tools::default());
    let (ctx, _) = ctx();
    let res = runner(s.client(), tools.clone(), RetryMode::WarmThenCold)
        .run(input(), &ctx)
        .await;
    match res.outcome {
        SectionOutcome::Completed { text } => assert!(text.contains("invalid arguments"), "{text}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        tools.count(),
        0,
        "a call with invalid arguments is never executed"
    );
}

#[tokio::test]
async fn partial_tool_call_proposal_never_executes() {
    // First response: a tool call cut off mid-arguments; the retry completes.
    let s = serve(|i, _| {
        if i == 0 {
            sse(&[tool_delta(0, Some("c1"), Some("publish"), "{\"to\": \"a")])
        } else {
            answer("no tools needed")
        }
    })
    .await;
    let tools = Arc::new(Tools::default());
    let mut r = SectionRunner::new(Arc::new(generator(s.client(), 3)), tools.clone());
    r.policy = SectionPolicy::default();
    let (ctx, _) = ctx();
    let res = r.run(input(), &ctx).await;
    assert!(matches!(res.outcome, SectionOutcome::Completed { .. }));
    assert_eq!(tools.count(), 0);
    assert_eq!(s.hits(), 2);
}

/// A 429 with `Retry-After` pauses the provider key (for every request of
/// the process, and through a coordinator for the fleet) instead of
/// spending an attempt: with one attempt allowed, three 429s in a row
/// still end in an answer, and the wait is reported as "waiting for
/// provider X until T".
#[tokio::test]
async fn rate_limits_with_retry_after_pause_instead_of_spending_attempts() {
    let s = serve(|i, _| {
        if i < 3 {
            status(
                429,
                &[("retry-after-ms", "40")],
                json!({"error":{"message":"slow down","code":"rate_limit_exceeded"}}),
            )
        } else {
            answer("ok")
        }
    })
    .await;
    let g = generator(s.client(), 1);
    let (ctx, rep) = ctx();
    let t = std::time::Instant::now();
    let out = g.generate(&req(), &ctx, &mut vec![]).await.unwrap();
    assert_eq!(out.completion.content, "ok");
    assert!(
        t.elapsed() >= Duration::from_millis(120),
        "each pause waited"
    );
    let reports = rep.take();
    let waits: Vec<_> = reports
        .iter()
        .filter(|r| r.reason.starts_with("waiting for provider "))
        .collect();
    assert_eq!(waits.len(), 3, "{reports:?}");
    assert!(waits[0].reason.contains(" until 20"), "{}", waits[0].reason);
    assert!(
        reports.iter().all(|r| r.eligible),
        "no attempt was spent: {reports:?}"
    );
}
