//! Providers that differ: structured-output forms learned from a refusal or
//! forced, the text tool protocol, refusals of a request's shape that are
//! never retried, configuration errors that end at once with their cause,
//! and a breaker that one always-failing request does not open.

mod common;

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use leasehold_agent::{
    SectionInput, SectionOutcome, SectionPolicy, SectionRunner, ToolExecutor, ToolOutcome,
};
use leasehold_model::adapt::TEXT_TOOL_LINE;
use leasehold_model::{
    BreakerConfig, BreakerState, Budget, ChatRequest, CollectingReporter, FailureClass,
    GenerationPolicy, Generator, ModelClient, ModelConfig, RunContext, StructuredMode, ToolsMode,
};
use leasehold_transcript::Message;
use serde_json::{json, Value};

fn policy(max_attempts: u32) -> GenerationPolicy {
    GenerationPolicy {
        max_attempts,
        base: Duration::from_millis(1),
        cap: Duration::from_millis(5),
        max_server_delay: Duration::from_secs(120),
    }
}

fn generator_of(cfg: ModelConfig, max_attempts: u32) -> Generator {
    Generator::new(
        ModelClient::new(cfg).unwrap(),
        policy(max_attempts),
        BreakerConfig {
            min_calls: 1000,
            ..Default::default()
        },
    )
}

fn ctx() -> (RunContext, Arc<CollectingReporter>) {
    let mut c = RunContext::new(Budget::unlimited());
    let rep = Arc::new(CollectingReporter::default());
    c.reporter = rep.clone();
    (c, rep)
}

fn schema_req() -> ChatRequest {
    ChatRequest {
        messages: vec![Message::system("You write outlines."), Message::user("go")],
        response_format: Some(
            json!({"type":"json_schema","json_schema":{"name":"o","schema":{"type":"object","properties":{"title":{"type":"string"}},"required":["title"]}}}),
        ),
        ..Default::default()
    }
}

/// llama-cpp-python's answer to `response_format: json_schema`.
fn llama_refusal() -> Vec<Step> {
    status(
        500,
        &[],
        json!({"error":{"message":"[{'type': 'literal_error', 'loc': ('body', 'response_format', 'type'), 'msg': \"Input should be 'text' or 'json_object'\", 'input': 'json_schema'}]","type":"internal_server_error","param":null,"code":null}}),
    )
}

/// A server that refuses `json_schema` and answers `json_object` with JSON.
async fn llama_like() -> TestServer {
    serve(|_, body| match body["response_format"]["type"].as_str() {
        Some("json_schema") => llama_refusal(),
        Some("json_object") => answer(r#"{"title":"Leases"}"#),
        _ => answer("```json\n{\"title\": \"Leases\"}\n```"),
    })
    .await
}

/// What one generator learned of a provider holds for every client
/// sharing its records (a worker's kind shares one `Providers`), and for
/// no other: there is no process-wide registry.
#[tokio::test]
async fn a_refused_json_schema_moves_to_json_object_once_for_the_clients_sharing_its_records() {
    let s = llama_like().await;
    let records = Arc::new(leasehold_model::Providers::default());
    let sharing = |cfg: ModelConfig| {
        Generator::new(
            ModelClient::new(cfg).unwrap().sharing(records.clone()),
            policy(3),
            BreakerConfig {
                min_calls: 1000,
                ..Default::default()
            },
        )
    };
    let g = sharing(s.config());
    let (ctx, rep) = ctx();
    let out = g.generate(&schema_req(), &ctx, &mut vec![]).await.unwrap();
    assert_eq!(out.completion.content, r#"{"title":"Leases"}"#);
    assert_eq!(s.hits(), 2, "one refusal, one answer");
    let sent = s.requests.lock().unwrap()[1].clone();
    assert_eq!(sent["response_format"]["type"], "json_object");
    assert_eq!(
        sent["response_format"]["schema"]["required"],
        json!(["title"])
    );
    let reports = rep.take();
    assert_eq!(reports.len(), 1, "{reports:?}");
    assert!(reports[0]
        .reason
        .contains("json_schema refused; json_object from now on"));
    // Another generator sharing the records starts there.
    let g2 = sharing(s.config());
    g2.generate(&schema_req(), &ctx, &mut vec![]).await.unwrap();
    assert_eq!(s.hits(), 3);
    assert_eq!(
        s.requests.lock().unwrap()[2]["response_format"]["type"],
        "json_object"
    );
    // One with records of its own learns for itself: refused once more.
    let g3 = generator_of(s.config(), 3);
    g3.generate(&schema_req(), &ctx, &mut vec![]).await.unwrap();
    assert_eq!(s.hits(), 5, "its own refusal, then its answer");
    assert_eq!(
        s.requests.lock().unwrap()[3]["response_format"]["type"],
        "json_schema"
    );
}

#[tokio::test]
async fn the_prompt_form_carries_the_schema_and_unwraps_the_answer() {
    let s = llama_like().await;
    let cfg = ModelConfig {
        structured: StructuredMode::Prompt,
        ..s.config()
    };
    let out = generator_of(cfg, 3)
        .generate(&schema_req(), &ctx().0, &mut vec![])
        .await
        .unwrap();
    assert_eq!(out.completion.content, r#"{"title": "Leases"}"#);
    let sent = s.requests.lock().unwrap()[0].clone();
    assert!(sent.get("response_format").is_none());
    let system = sent["messages"][0]["content"].as_str().unwrap();
    assert!(system.contains("matches this JSON Schema") && system.contains("\"title\""));
}

#[tokio::test]
async fn a_forced_form_the_provider_refuses_fails_at_once_with_the_setting() {
    let s = llama_like().await;
    let cfg = ModelConfig {
        structured: StructuredMode::JsonSchema,
        ..s.config()
    };
    let f = generator_of(cfg, 3)
        .generate(&schema_req(), &ctx().0, &mut vec![])
        .await
        .unwrap_err();
    assert_eq!(f.error.class(), FailureClass::Config);
    assert!(
        f.error.to_string().contains("LH_MODEL_STRUCTURED"),
        "{}",
        f.error
    );
    assert!(
        f.error.to_string().contains("Input should be"),
        "{}",
        f.error
    );
    assert_eq!(s.hits(), 1, "never retried");
}

#[tokio::test]
async fn a_500_that_says_the_request_is_invalid_is_never_retried() {
    let s = serve(|_, _| llama_refusal()).await;
    let req = ChatRequest {
        messages: vec![Message::user("hi")],
        ..Default::default()
    };
    let f = generator_of(s.config(), 3)
        .generate(&req, &ctx().0, &mut vec![])
        .await
        .unwrap_err();
    assert_eq!(f.error.class(), FailureClass::BadRequest);
    assert_eq!(s.hits(), 1);
}

/// Records calls; `search` answers with a URL.
#[derive(Default)]
struct Tools(Mutex<Vec<(String, Value)>>);

impl ToolExecutor for Tools {
    fn specs(&self) -> Vec<Value> {
        vec![leasehold_model::function_tool(
            "search",
            "Search the web.",
            json!({"type":"object","properties":{"q":{"type":"string"}},"required":["q"]}),
        )]
    }
    fn call<'a>(
        &'a self,
        name: &'a str,
        args: &'a Value,
        _call_id: &'a str,
    ) -> Pin<Box<dyn Future<Output = ToolOutcome> + Send + 'a>> {
        self.0.lock().unwrap().push((name.into(), args.clone()));
        Box::pin(async { ToolOutcome::Ok(r#"{"url":"http://x/1"}"#.into()) })
    }
}

fn has_tool_result(body: &Value) -> bool {
    body["messages"].as_array().is_some_and(|m| {
        m.iter().any(|m| {
            m["role"] == "user"
                && m["content"]
                    .as_str()
                    .is_some_and(|c| c.starts_with("<tool_result name=\"search\">"))
        })
    })
}

#[tokio::test]
async fn without_native_tools_the_text_protocol_runs_the_tool_loop() {
    // Refuses `tools`, as a server whose model has no tool calling does.
    let s = serve(|_, body| {
        if body.get("tools").is_some() {
            return status(
                400,
                &[],
                json!({"error":{"message":"this model does not support tools","type":"invalid_request_error"}}),
            );
        }
        let system = body["messages"][0]["content"].as_str().unwrap_or("");
        assert!(system.contains(TEXT_TOOL_LINE), "{system}");
        if has_tool_result(body) {
            answer("The section, citing http://x/1.")
        } else {
            answer("<tool_call>{\"name\": \"search\", \"arguments\": {\"q\": \"leases\"}}</tool_call>")
        }
    })
    .await;
    let tools = Arc::new(Tools::default());
    let runner = SectionRunner {
        policy: SectionPolicy::default(),
        ..SectionRunner::new(Arc::new(generator_of(s.config(), 3)), tools.clone())
    };
    let (ctx, rep) = ctx();
    let r = runner
        .run(
            SectionInput {
                system: "You research.".into(),
                section_prompt: "Write about leases.".into(),
                ..Default::default()
            },
            &ctx,
        )
        .await;
    assert_eq!(
        r.outcome,
        SectionOutcome::Completed {
            text: "The section, citing http://x/1.".into()
        }
    );
    assert_eq!(
        *tools.0.lock().unwrap(),
        vec![("search".to_string(), json!({"q": "leases"}))]
    );
    assert_eq!(s.hits(), 3, "a refusal, a text tool call, the answer");
    assert!(rep
        .take()
        .iter()
        .any(|r| r.reason.contains("tools native refused; text from now on")));
    // The transcript keeps the canonical form: a tool call and a tool result.
    assert!(r
        .thread
        .messages
        .iter()
        .any(|m| matches!(m, Message::Tool { .. })));
}

#[tokio::test]
async fn tools_none_answers_without_them() {
    let s = serve(|_, body| {
        assert!(body.get("tools").is_none());
        answer("From what I know.")
    })
    .await;
    let cfg = ModelConfig {
        tools: ToolsMode::None,
        ..s.config()
    };
    let tools = Arc::new(Tools::default());
    let r = SectionRunner::new(Arc::new(generator_of(cfg, 3)), tools.clone())
        .run(
            SectionInput {
                section_prompt: "Write.".into(),
                ..Default::default()
            },
            &ctx().0,
        )
        .await;
    assert!(matches!(r.outcome, SectionOutcome::Completed { .. }));
    assert_eq!(r.tool_calls, 0);
}

#[tokio::test]
async fn an_endpoint_that_refuses_connections_is_a_configuration_error_within_seconds() {
    // A port nothing listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let cfg = ModelConfig {
        base_url: format!("http://127.0.0.1:{port}/v1"),
        ..ModelConfig::default()
    };
    let started = Instant::now();
    let f = generator_of(cfg, 3)
        .generate(&schema_req(), &ctx().0, &mut vec![])
        .await
        .unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(f.error.class(), FailureClass::Config);
    let m = f.error.to_string();
    assert!(
        m.contains("cannot reach the model endpoint") && m.contains("LH_MODEL_BASE_URL"),
        "{m}"
    );
    assert!(m.to_lowercase().contains("connect"), "the cause: {m}");
}

#[tokio::test]
async fn a_provider_is_known_to_answer_after_its_first_completion() {
    let s = serve(|_, _| answer("hi")).await;
    let cfg = s.config();
    let g = generator_of(cfg.clone(), 2);
    g.generate(&schema_req(), &ctx().0, &mut vec![])
        .await
        .unwrap();
    // From now on a connect failure of it is an outage (retried), not a
    // configuration error.
    assert!(g.client.provider(&cfg.model).has_answered());
}

#[tokio::test]
async fn an_html_page_is_a_configuration_error_not_an_incomplete_generation() {
    let s = serve(|_, _| {
        let page = "<html><body>It works!</body></html>";
        vec![Step::Write(
            format!(
                "HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{page}",
                page.len()
            )
            .into_bytes(),
        )]
    })
    .await;
    for stream in [true, false] {
        let cfg = ModelConfig {
            stream,
            ..s.config()
        };
        let f = generator_of(cfg, 3)
            .generate(&schema_req(), &ctx().0, &mut vec![])
            .await
            .unwrap_err();
        assert_eq!(f.error.class(), FailureClass::Config, "stream {stream}");
        assert!(f.error.to_string().contains("text/html") || f.error.to_string().contains("HTML"));
        assert!(f.error.to_string().contains("LH_MODEL_BASE_URL"));
    }
    assert_eq!(s.hits(), 2, "one request each, never retried");
}

#[tokio::test]
async fn a_server_that_ignores_stream_true_is_read_whole() {
    let s = serve(|_, _| {
        let body = json!({"choices":[{"message":{"role":"assistant","content":"whole"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}).to_string();
        vec![Step::Write(
            format!(
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            )
            .into_bytes(),
        )]
    })
    .await;
    let out = generator_of(s.config(), 3)
        .generate(&schema_req(), &ctx().0, &mut vec![])
        .await
        .unwrap();
    assert_eq!(out.completion.content, "whole");
    assert_eq!(out.completion.usage.total_tokens, 4);
}

#[tokio::test]
async fn one_request_that_always_fails_never_opens_the_breaker_for_the_others() {
    let s = serve(|_, body| {
        let last = body["messages"][0]["content"].as_str().unwrap_or("");
        if last.starts_with("poison") {
            status(500, &[], json!({"error":{"message":"boom"}}))
        } else {
            answer("fine")
        }
    })
    .await;
    let g = Generator::new(
        s.client(),
        policy(3),
        BreakerConfig {
            min_calls: 4,
            failure_rate: 0.5,
            cool_down: Duration::from_secs(30),
            ..Default::default()
        },
    );
    let (ctx, _) = ctx();
    let poison = ChatRequest {
        messages: vec![Message::user("poison")],
        ..Default::default()
    };
    for _ in 0..5 {
        let f = g.generate(&poison, &ctx, &mut vec![]).await.unwrap_err();
        assert_eq!(f.error.class(), FailureClass::ServerError);
    }
    assert_eq!(
        g.breaker.state(),
        BreakerState::Closed,
        "15 failures of one request"
    );
    let healthy = ChatRequest {
        messages: vec![Message::user("healthy")],
        ..Default::default()
    };
    let ok = g.generate(&healthy, &ctx, &mut vec![]).await.unwrap();
    assert_eq!(ok.attempts, 1);
    // Distinct requests failing are a storm: it opens (and a call after
    // that fails fast instead of waiting out the cool-down).
    let mut ctx = ctx;
    ctx.deadline = Some(tokio::time::Instant::now() + Duration::from_secs(2));
    for i in 0..4 {
        let r = ChatRequest {
            messages: vec![Message::user(format!("poison {i}"))],
            ..Default::default()
        };
        let _ = g.generate(&r, &ctx, &mut vec![]).await;
    }
    assert_eq!(g.breaker.state(), BreakerState::Open);
}
