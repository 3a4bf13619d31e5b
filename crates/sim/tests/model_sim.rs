//! The simulated model, run as the real `leasehold-sim` binary, driven
//! through leasehold's own model client and section runner.

use std::future::Future;
use std::io::{BufRead, BufReader};
use std::pin::Pin;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use leasehold_model::agent::{
    SectionInput, SectionOutcome, SectionRunner, ToolExecutor, ToolOutcome,
};
use leasehold_model::{
    function_tool, AttemptState, BreakerConfig, Budget, ChatRequest, CollectingReporter,
    GenerationPolicy, Generator, ModelClient, ModelConfig, RunContext,
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
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_leasehold-sim"));
        cmd.args(["--listen", "127.0.0.1:0", "--seed", "7"])
            .env("LH_SIM_TOKEN_DELAY_MS", "0")
            .env_remove("LH_SIM_FAULT_RATE")
            .env_remove("LH_SIM_FAULTS")
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
        leasehold_model::agent::RetryMode::WarmThenCold,
        leasehold_model::agent::RetryMode::NaiveWholeTurn,
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
