//! The simulated model, run as the real `leasehold-sim` binary, driven
//! through leasehold's own model client and section runner.

use std::future::Future;
use std::io::{BufRead, BufReader};
use std::pin::Pin;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use leasehold_agent::{SectionInput, SectionOutcome, SectionRunner, ToolExecutor, ToolOutcome};
use leasehold_model::{
    function_tool, AttemptState, BreakerConfig, Budget, ChatRequest, CollectingReporter, Generated,
    GenerationFailure, GenerationPolicy, Generator, ModelClient, ModelConfig, RetryReport,
    RunContext,
};
use leasehold_transcript::Message;
use serde_json::{json, Value};

/// A running simulator, killed on drop.
struct Sim {
    child: Child,
    addr: String,
}

impl Sim {
    fn start(faults: Option<Value>) -> Sim {
        Sim::start_with(faults, &[])
    }
    fn start_with(faults: Option<Value>, env: &[(&str, &str)]) -> Sim {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_leasehold-sim"));
        cmd.args(["--listen", "127.0.0.1:0", "--seed", "7"])
            .env("LH_SIM_TOKEN_DELAY_MS", "0")
            .env_remove("LH_SIM_FAULT_RATE")
            .env_remove("LH_SIM_FAULTS")
            .env_remove("LH_SIM_SERVE")
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        if let Some(f) = faults {
            let path = std::env::temp_dir().join(format!(
                "lh-sim-faults-{}-{}.json",
                std::process::id(),
                rand_suffix()
            ));
            std::fs::write(&path, f.to_string()).unwrap();
            cmd.arg("--faults").arg(path);
        }
        let mut child = cmd.spawn().expect("leasehold-sim binary");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = line
            .trim()
            .strip_prefix("listening on ")
            .expect("listening line")
            .to_string();
        Sim { child, addr }
    }
    fn client(&self) -> ModelClient {
        ModelClient::new(ModelConfig {
            base_url: format!("http://{}/v1", self.addr),
            model: "sim-1".into(),
            first_byte_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(5),
            ..Default::default()
        })
        .unwrap()
    }
    async fn stats(&self) -> Value {
        reqwest::get(format!("http://{}/stats", self.addr))
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn rand_suffix() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

/// search returns one result pointing at a page; fetch returns its text.
#[derive(Default)]
struct Tools(Mutex<Vec<(String, Value)>>);

impl ToolExecutor for Tools {
    fn specs(&self) -> Vec<Value> {
        vec![
            function_tool(
                "search",
                "web search",
                json!({"type":"object","properties":{"q":{"type":"string"}},"required":["q"]}),
            ),
            function_tool(
                "fetch",
                "fetch a page",
                json!({"type":"object","properties":{"url":{"type":"string"}},"required":["url"]}),
            ),
        ]
    }
    fn call<'a>(
        &'a self,
        name: &'a str,
        args: &'a Value,
        _id: &'a str,
    ) -> Pin<Box<dyn Future<Output = ToolOutcome> + Send + 'a>> {
        Box::pin(async move {
            self.0
                .lock()
                .unwrap()
                .push((name.to_string(), args.clone()));
            match name {
                "search" => ToolOutcome::Ok(json!({"results":[{"title":"Leases","url":"http://example.test/page/leases","content":"..."}]}).to_string()),
                _ => ToolOutcome::Ok("Leases expire; fencing tokens refuse stale writers.".into()),
            }
        })
    }
}

fn runner(sim: &Sim, tools: Arc<Tools>) -> SectionRunner {
    let policy = GenerationPolicy {
        max_attempts: 3,
        base: Duration::from_millis(1),
        cap: Duration::from_millis(10),
        ..Default::default()
    };
    // A tolerant breaker: these tests inject many faults on purpose.
    let breaker = BreakerConfig {
        min_calls: 100,
        ..Default::default()
    };
    SectionRunner::new(
        Arc::new(Generator::new(sim.client(), policy, breaker)),
        tools,
    )
}

fn input() -> SectionInput {
    SectionInput {
        system: "You are a research agent.".into(),
        section_prompt: "Write the section on lease-based ownership.".into(),
        rolling_context: String::new(),
        initial: None,
    }
}

#[tokio::test]
async fn sim_plays_search_fetch_write() {
    let sim = Sim::start(None);
    let tools = Arc::new(Tools::default());
    let ctx = RunContext::new(Budget::unlimited());
    let res = runner(&sim, tools.clone()).run(input(), &ctx).await;
    match &res.outcome {
        SectionOutcome::Completed { text } => {
            assert!(text.starts_with("## "), "{text}");
            assert!(
                text.contains("http://example.test/page/leases"),
                "cites the fetched URL: {text}"
            );
        }
        other => panic!("{other:?}"),
    }
    let calls = tools.0.lock().unwrap().clone();
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[0].0, "search");
    assert!(calls[0].1["q"].as_str().unwrap().contains("lease"));
    assert_eq!(
        calls[1],
        (
            "fetch".to_string(),
            json!({"url": "http://example.test/page/leases"})
        )
    );
    let stats = sim.stats().await;
    assert_eq!(stats["chat_requests"], 3);
    assert_eq!(stats["tool_calls_proposed"], 2);
}

#[tokio::test]
async fn sim_faults_are_recovered_by_generation_and_warm_retries() {
    // Request 2 (the fetch proposal) is cut; request 4 gets a 429; request 5
    // has an error event mid-stream.
    let sim = Sim::start(Some(json!({"rules":[
        {"kind":"cut","nth":[2]},
        {"kind":"rate_limit","nth":[4],"retry_after":"0"},
        {"kind":"error_event","nth":[5]}
    ]})));
    let tools = Arc::new(Tools::default());
    let mut ctx = RunContext::new(Budget::unlimited());
    let rep = Arc::new(CollectingReporter::default());
    ctx.reporter = rep.clone();
    let res = runner(&sim, tools.clone()).run(input(), &ctx).await;
    assert!(
        matches!(res.outcome, SectionOutcome::Completed { .. }),
        "{:?}",
        res.outcome
    );
    // The cut proposal never executed: exactly one search and one fetch.
    assert_eq!(tools.0.lock().unwrap().len(), 2);
    let stats = sim.stats().await;
    assert_eq!(
        stats["faults"],
        json!({"cut":1,"rate_limit":1,"error_event":1})
    );
    let reports = rep.take();
    assert_eq!(reports.len(), 3, "{reports:#?}");
}

#[tokio::test]
async fn sim_header_faults_and_structured_output() {
    let sim = Sim::start(None);
    let http = reqwest::Client::new();
    let url = format!("http://{}/v1/chat/completions", sim.addr);
    let body = json!({"model":"sim-1","stream":true,"messages":[{"role":"user","content":"hi"}]});
    let r = http
        .post(&url)
        .header("x-sim-fault", "empty")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.text().await.unwrap(), "");
    let r = http
        .post(&url)
        .header("x-sim-fault", "rate_limit")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    assert!(r.headers().get("retry-after").is_some());
    let r = http
        .post(&url)
        .header("x-sim-fault", "context_exceeded")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);

    // Any schema gets a conforming instance, streaming and not.
    let schema = json!({"type":"object","required":["title","points"],"properties":{"title":{"type":"string"},"points":{"type":"array","minItems":2,"maxItems":4,"items":{"type":"object","required":["text","weight"],"properties":{"text":{"type":"string"},"weight":{"type":"integer"}}}},"kind":{"enum":["x","y"]}}});
    for stream in [true, false] {
        let client = ModelClient::new(ModelConfig {
            stream,
            ..sim.client().config().clone()
        })
        .unwrap();
        let req = ChatRequest {
            messages: vec![Message::user("Outline leases")],
            response_format: Some(
                json!({"type":"json_schema","json_schema":{"name":"outline","schema":schema}}),
            ),
            ..Default::default()
        };
        let c = client
            .generate_once(&req, "sim-1", &mut AttemptState::default())
            .await
            .unwrap();
        let v: Value = serde_json::from_str(&c.content).unwrap();
        assert!(v["title"].is_string());
        assert_eq!(v["points"].as_array().unwrap().len(), 2);
        assert!(v["points"][0]["weight"].is_i64());
        assert_eq!(v["kind"], "x");
    }
}

#[tokio::test]
async fn sim_naive_whole_turn_retry_repeats_tools_that_warm_retry_keeps() {
    let mut executed = Vec::new();
    for mode in [
        leasehold_agent::RetryMode::WarmThenCold,
        leasehold_agent::RetryMode::NaiveWholeTurn,
    ] {
        // Request 3 (the section write after search and fetch) is cut.
        let sim = Sim::start(Some(json!({"rules":[{"kind":"cut","nth":[3]}]})));
        let tools = Arc::new(Tools::default());
        let policy = GenerationPolicy {
            max_attempts: 1, // push the failure up to the section level
            ..Default::default()
        };
        let mut r = SectionRunner::new(
            Arc::new(Generator::new(
                sim.client(),
                policy,
                BreakerConfig::default(),
            )),
            tools.clone(),
        );
        r.policy.mode = mode;
        let res = r.run(input(), &RunContext::new(Budget::unlimited())).await;
        assert!(
            matches!(res.outcome, SectionOutcome::Completed { .. }),
            "{mode:?}: {:?}",
            res.outcome
        );
        executed.push(tools.0.lock().unwrap().len());
    }
    assert_eq!(
        executed,
        vec![2, 4],
        "warm keeps search+fetch results; naive runs them again"
    );
}

/// Two sections at once against a server that serves one request at a
/// time and cuts the stream in flight for a newcomer (llama-cpp-python's
/// default): the first cut is counted as a sign, the second learns a
/// concurrency of 1, and from then on the two take turns. Neither cut is
/// an attempt: with one generation attempt per section attempt, a counted
/// cut would have been a warm retry, and there is none.
#[tokio::test]
async fn sim_two_sections_on_a_server_that_interrupts_learn_one_at_a_time() {
    let sim = Sim::start_with(
        None,
        &[
            ("LH_SIM_SERVE", "interrupts"),
            ("LH_SIM_TOKEN_DELAY_MS", "3"),
        ],
    );
    let policy = GenerationPolicy {
        max_attempts: 1,
        ..Default::default()
    };
    let generator = Arc::new(Generator::new(
        sim.client(),
        policy,
        BreakerConfig::default(),
    ));
    let mut ctx = RunContext::new(Budget::unlimited());
    let rep = Arc::new(CollectingReporter::default());
    ctx.reporter = rep.clone();
    let run = |tools: Arc<Tools>| {
        let r = SectionRunner::new(generator.clone(), tools);
        let ctx = ctx.clone();
        async move { r.run(input(), &ctx).await }
    };
    let (a, b) = futures::future::join(
        run(Arc::new(Tools::default())),
        run(Arc::new(Tools::default())),
    )
    .await;
    for res in [&a, &b] {
        assert!(
            matches!(res.outcome, SectionOutcome::Completed { .. }),
            "{:?}",
            res.outcome
        );
    }
    let stats = sim.stats().await;
    let reports = rep.take();
    let reasons: Vec<&str> = reports.iter().map(|r| r.reason.as_str()).collect();
    assert_eq!(stats["serve"], "interrupts");
    assert_eq!(
        stats["interrupted"], 2,
        "two cuts, then one at a time: {stats}\n{reasons:#?}"
    );
    assert_eq!(reports.len(), 2, "{reasons:#?}");
    assert!(
        reports
            .iter()
            .all(|r| r.scope == leasehold_model::RetryScope::Generation && r.eligible),
        "no section retry: {reasons:#?}"
    );
    assert!(reasons[0].contains("(1 of 2"), "{reasons:#?}");
    assert!(
        reasons[1].contains("serves one request at a time; concurrency 1 from now on"),
        "{reasons:#?}"
    );
    assert!(reasons.iter().all(|r| r.contains("not an attempt")));
    let key = leasehold_flow::ProviderKey::new(&sim.client().config().base_url, "sim-1", None);
    assert_eq!(ctx.flow.learned(&key.id).map(|l| l.concurrency), Some(1));
}

/// A concurrency set by hand (LH_MODEL_CONCURRENCY) above 1 is never moved
/// by what is seen: the cut counts as an attempt, and the report says which
/// setting to change.
#[tokio::test]
async fn sim_a_concurrency_set_by_hand_is_never_moved_by_cuts() {
    let sim = Sim::start_with(
        None,
        &[
            ("LH_SIM_SERVE", "interrupts"),
            ("LH_SIM_TOKEN_DELAY_MS", "3"),
        ],
    );
    let client = ModelClient::new(ModelConfig {
        concurrency: Some(2),
        ..sim.client().config().clone()
    })
    .unwrap();
    let policy = GenerationPolicy {
        max_attempts: 4,
        base: Duration::from_millis(1),
        cap: Duration::from_millis(5),
        ..Default::default()
    };
    let g = Arc::new(Generator::new(client, policy, BreakerConfig::default()));
    let (_a, _b, reports, flow) = two_at_once(&g).await;
    assert!(!reports.is_empty(), "the server cut a stream");
    assert!(
        reports.iter().any(|r| r.reason.contains(
            "it serves one request at a time), but LH_MODEL_CONCURRENCY sets a concurrency of 2: set 1"
        )),
        "{reports:#?}"
    );
    assert!(reports.iter().all(|r| !r.reason.contains("not an attempt")));
    let key = leasehold_flow::ProviderKey::new(&sim.client().config().base_url, "sim-1", None);
    assert_eq!(flow.learned(&key.id), None, "nothing learned");
    assert_eq!(
        flow.limits(&key.id).and_then(|l| l.concurrency),
        Some(2),
        "what was set holds"
    );
}

/// A stream that just stops (the connection ends, no `[DONE]`: a
/// transport failure) while another request waits is not the mark of a
/// server that serves one at a time: an ordinary incomplete generation,
/// an attempt, and nothing learned.
#[tokio::test]
async fn sim_a_stream_that_just_stops_is_not_taken_for_one_at_a_time() {
    let sim = Sim::start_with(
        Some(json!({"rules":[{"kind":"cut","nth":[1, 2, 3]}]})),
        &[("LH_SIM_TOKEN_DELAY_MS", "3")],
    );
    let policy = GenerationPolicy {
        max_attempts: 5,
        base: Duration::from_millis(1),
        cap: Duration::from_millis(5),
        ..Default::default()
    };
    let g = Arc::new(Generator::new(
        sim.client(),
        policy,
        BreakerConfig::default(),
    ));
    let (a, b, reports, flow) = two_at_once(&g).await;
    assert!(a.is_ok() && b.is_ok(), "{a:?} {b:?}");
    assert_eq!(
        reports.len(),
        3,
        "three cuts, each an attempt: {reports:#?}"
    );
    assert!(reports.iter().all(|r| !r.reason.contains("not an attempt")));
    let key = leasehold_flow::ProviderKey::new(&sim.client().config().base_url, "sim-1", None);
    assert_eq!(flow.learned(&key.id), None);
}

/// Two generations of the same request at once through `g` (one run's
/// flow control), the retry reports they made, and that flow control.
async fn two_at_once(
    g: &Arc<Generator>,
) -> (
    Result<Generated, GenerationFailure>,
    Result<Generated, GenerationFailure>,
    Vec<RetryReport>,
    Arc<leasehold_flow::Flow>,
) {
    let mut ctx = RunContext::new(Budget::unlimited());
    let rep = Arc::new(CollectingReporter::default());
    ctx.reporter = rep.clone();
    let req = ChatRequest {
        messages: vec![Message::user("Write the section on lease-based ownership.")],
        ..Default::default()
    };
    let gen = || {
        let (g, ctx, req) = (g.clone(), ctx.clone(), req.clone());
        async move { g.generate(&req, &ctx, &mut Vec::new()).await }
    };
    let (a, b) = futures::future::join(gen(), gen()).await;
    (a, b, rep.take(), ctx.flow.clone())
}
