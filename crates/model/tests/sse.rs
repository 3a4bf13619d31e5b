//! The SSE decoder and one generation attempt, through a real HTTP socket.

mod common;

use std::time::Duration;

use common::*;
use leasehold_model::{
    AttemptState, ChatRequest, FailureClass, ModelClient, ModelConfig, ModelError, Quirks,
};
use leasehold_transcript::Message;
use serde_json::json;

fn req() -> ChatRequest {
    ChatRequest {
        messages: vec![Message::user("hi")],
        ..Default::default()
    }
}

async fn once(
    server: &TestServer,
) -> (
    Result<leasehold_model::Completion, ModelError>,
    AttemptState,
) {
    once_with(&server.client()).await
}

async fn once_with(
    client: &ModelClient,
) -> (
    Result<leasehold_model::Completion, ModelError>,
    AttemptState,
) {
    let mut st = AttemptState::default();
    let model = client.config().model.clone();
    let r = client.generate_once(&req(), &model, &mut st).await;
    (r, st)
}

#[tokio::test]
async fn normal_stream_completes_with_usage() {
    let s = serve(|_, _| {
        sse(&[
            content("Hello"),
            content(", world"),
            finish("stop"),
            usage(7, 3),
            done(),
        ])
    })
    .await;
    let (r, st) = once(&s).await;
    let c = r.unwrap();
    assert_eq!(c.content, "Hello, world");
    assert_eq!(c.finish_reason, "stop");
    assert_eq!(c.usage.total_tokens, 10);
    assert!(!c.usage.estimated);
    assert!(c.done_seen && st.completed);
    // The request asked for streaming with usage.
    let body = &s.requests.lock().unwrap()[0];
    assert_eq!(body["stream"], true);
    assert_eq!(body["stream_options"]["include_usage"], true);
    assert_eq!(body["model"], "test-model");
}

#[tokio::test]
async fn missing_done_after_finish_is_complete_unless_required() {
    let s = serve(|_, _| sse(&[content("ok"), finish("stop")])).await;
    let (r, _) = once(&s).await;
    let c = r.unwrap();
    assert!(!c.done_seen);
    // Usage absent: estimated.
    assert!(c.usage.estimated);
    let cfg = ModelConfig {
        quirks: Quirks {
            require_done: true,
            ..Default::default()
        },
        ..s.config()
    };
    let (r, _) = once_with(&ModelClient::new(cfg).unwrap()).await;
    assert_eq!(r.unwrap_err().class(), FailureClass::IncompleteGeneration);
}

#[tokio::test]
async fn ended_before_finish_is_incomplete() {
    let s = serve(|_, _| sse(&[content("The answer is")])).await;
    let (r, st) = once(&s).await;
    assert!(matches!(r, Err(ModelError::Incomplete(_))));
    assert!(!st.completed);
    // [DONE] alone is not success either.
    let s = serve(|_, _| sse(&[content("The answer is"), done()])).await;
    assert_eq!(
        once(&s).await.0.unwrap_err().class(),
        FailureClass::IncompleteGeneration
    );
}

#[tokio::test]
async fn http_200_with_zero_events_is_incomplete() {
    let s = serve(|_, _| sse(&[])).await;
    let (r, _) = once(&s).await;
    match r {
        Err(ModelError::Incomplete(m)) => assert!(m.contains("no events")),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn explicit_error_object_is_a_failure_with_its_class_even_with_done() {
    // vLLM: data: {"error":{...,"code":503}} then [DONE], on HTTP 200.
    let s = serve(|_, _| {
        sse(&[
            content("par"),
            data(json!({"error":{"message":"busy","type":"ServiceUnavailable","code":503}})),
            done(),
        ])
    })
    .await;
    let (r, _) = once(&s).await;
    assert!(
        matches!(
            r,
            Err(ModelError::StreamError {
                class: FailureClass::Overloaded,
                ..
            })
        ),
        "{r:?}"
    );
    // Anthropic-style `event: error` overload mid-stream.
    let s = serve(|_, _| sse(&[content("x"), "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"Overloaded\"}}\n\n".into()])).await;
    assert_eq!(
        once(&s).await.0.unwrap_err().class(),
        FailureClass::Overloaded
    );
    // vLLM code-less context error, integer code 400.
    let s = serve(|_, _| sse(&[data(json!({"error":{"message":"This model's maximum context length is 4096 tokens","type":"BadRequestError","code":400}})), done()])).await;
    assert_eq!(
        once(&s).await.0.unwrap_err().class(),
        FailureClass::ContextExceeded
    );
}

#[tokio::test]
async fn crlf_line_endings() {
    let s = serve(|_, _| {
        let body = [content("a"), content("b"), finish("stop"), done()]
            .concat()
            .replace('\n', "\r\n");
        vec![Step::Write(format!("{SSE_HEAD}{body}").into_bytes())]
    })
    .await;
    assert_eq!(once(&s).await.0.unwrap().content, "ab");
}

#[tokio::test]
async fn comments_and_keepalives_are_ignored() {
    let s = serve(|_, _| {
        sse(&[
            ": keep-alive\n\n".into(),
            content("a"),
            ":ping\n\n".into(),
            content("b"),
            ": x\n".into(),
            finish("stop"),
            done(),
        ])
    })
    .await;
    assert_eq!(once(&s).await.0.unwrap().content, "ab");
}

#[tokio::test]
async fn one_event_split_across_tcp_writes_at_every_byte_boundary() {
    let event = content("héllo wörld");
    let tail = [finish("stop"), done()].concat();
    let len = event.len();
    for cut in 1..len {
        let (e, t) = (event.clone(), tail.clone());
        let s = serve(move |_, _| {
            vec![
                Step::Write(SSE_HEAD.as_bytes().to_vec()),
                Step::Write(e.as_bytes()[..cut].to_vec()),
                Step::Pause(Duration::from_millis(1)),
                Step::Write(e.as_bytes()[cut..].to_vec()),
                Step::Write(t.clone().into_bytes()),
            ]
        })
        .await;
        let c = once(&s)
            .await
            .0
            .unwrap_or_else(|e| panic!("cut {cut}: {e}"));
        assert_eq!(c.content, "héllo wörld", "cut {cut}");
    }
}

#[tokio::test]
async fn multi_line_data_is_joined() {
    let chunk =
        r#"{"id":"c","choices":[{"index":0,"delta":{"content":"multi"},"finish_reason":null}]}"#;
    let (a, b) = chunk.split_at(30);
    let ev = format!("data: {a}\ndata: {b}\n\n");
    let s = serve(move |_, _| sse(&[ev.clone(), finish("stop"), done()])).await;
    assert_eq!(once(&s).await.0.unwrap().content, "multi");
}

#[tokio::test]
async fn tool_call_argument_fragments_across_chunks() {
    let s = serve(|_, _| {
        sse(&[
            tool_delta(0, Some("call_1"), Some("search"), ""),
            tool_delta(0, None, None, "{\"que"),
            tool_delta(0, None, None, "ry\": \"lea"),
            tool_delta(0, None, None, "ses\"}"),
            finish("tool_calls"),
            done(),
        ])
    })
    .await;
    let c = once(&s).await.0.unwrap();
    assert_eq!(c.tool_calls.len(), 1);
    assert_eq!(c.tool_calls[0].id, "call_1");
    assert_eq!(c.tool_calls[0].function.name, "search");
    assert_eq!(
        c.tool_calls[0].function.arguments,
        "{\"query\": \"leases\"}"
    );
}

#[tokio::test]
async fn interleaved_parallel_tool_calls() {
    let s = serve(|_, _| {
        sse(&[
            tool_delta(0, Some("a"), Some("search"), "{\"q\":"),
            tool_delta(1, Some("b"), Some("fetch"), "{\"url\":"),
            tool_delta(0, None, None, "\"x\"}"),
            tool_delta(1, None, None, "\"http://y\"}"),
            finish("tool_calls"),
            done(),
        ])
    })
    .await;
    let c = once(&s).await.0.unwrap();
    let got: Vec<_> = c
        .tool_calls
        .iter()
        .map(|t| {
            (
                t.id.as_str(),
                t.function.name.as_str(),
                t.function.arguments.as_str(),
            )
        })
        .collect();
    assert_eq!(
        got,
        vec![
            ("a", "search", "{\"q\":\"x\"}"),
            ("b", "fetch", "{\"url\":\"http://y\"}")
        ]
    );
}

#[tokio::test]
async fn ollama_whole_tool_call_in_one_chunk_without_usage() {
    let s = serve(|_, _| {
        sse(&[
            data(json!({"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]})),
            data(json!({"choices":[{"index":0,"delta":{"tool_calls":[{"id":"call_x","index":0,"type":"function","function":{"name":"search","arguments":"{\"query\":\"q\"}"}}]},"finish_reason":null}]})),
            finish("tool_calls"),
            done(),
        ])
    })
    .await;
    let c = once(&s).await.0.unwrap();
    assert_eq!(c.tool_calls[0].function.arguments, "{\"query\":\"q\"}");
    assert!(c.usage.estimated && c.usage.total_tokens > 0);
}

#[tokio::test]
async fn rate_limit_with_both_retry_after_forms_and_ms() {
    let s = serve(|i, _| match i {
        0 => status(
            429,
            &[("Retry-After", "3")],
            json!({"error":{"message":"slow down","type":"requests","code":"rate_limit_exceeded"}}),
        ),
        1 => {
            let at =
                httpdate::fmt_http_date(std::time::SystemTime::now() + Duration::from_secs(120));
            status(
                429,
                &[("Retry-After", at.as_str())],
                json!({"error":{"message":"slow down"}}),
            )
        }
        _ => status(
            429,
            &[("retry-after-ms", "1500"), ("Retry-After", "9")],
            json!({"error":{"message":"slow down"}}),
        ),
    })
    .await;
    let e = once(&s).await.0.unwrap_err();
    assert_eq!(e.class(), FailureClass::RateLimited);
    assert_eq!(e.retry_after(), Some(Duration::from_secs(3)));
    let e = once(&s).await.0.unwrap_err();
    let ra = e.retry_after().unwrap();
    assert!(
        ra > Duration::from_secs(100) && ra <= Duration::from_secs(120),
        "{ra:?}"
    );
    let e = once(&s).await.0.unwrap_err();
    assert_eq!(e.retry_after(), Some(Duration::from_millis(1500)));
}

#[tokio::test]
async fn quota_429_is_terminal() {
    let s = serve(|_, _| status(429, &[], json!({"error":{"message":"You exceeded your current quota","type":"insufficient_quota","code":"insufficient_quota"}}))).await;
    let e = once(&s).await.0.unwrap_err();
    assert_eq!(e.class(), FailureClass::QuotaExhausted);
    assert!(!e.is_retryable());
}

#[tokio::test]
async fn server_500_and_auth() {
    let s = serve(|i, _| {
        if i == 0 {
            status(500, &[], json!({"error":{"message":"boom"}}))
        } else {
            status(
                401,
                &[],
                json!({"error":{"message":"bad key","code":"invalid_api_key"}}),
            )
        }
    })
    .await;
    let e = once(&s).await.0.unwrap_err();
    assert_eq!(e.class(), FailureClass::ServerError);
    assert!(e.is_retryable());
    let e = once(&s).await.0.unwrap_err();
    assert_eq!(e.class(), FailureClass::Auth);
    assert!(!e.is_retryable());
}

fn short(server: &TestServer) -> ModelClient {
    ModelClient::new(ModelConfig {
        first_byte_timeout: Duration::from_millis(300),
        idle_timeout: Duration::from_millis(300),
        ..server.config()
    })
    .unwrap()
}

#[tokio::test]
async fn hang_before_headers_and_mid_stream_are_read_timeouts() {
    let s = serve(|_, _| vec![Step::Hang]).await;
    let (r, _) = once_with(&short(&s)).await;
    assert_eq!(r.unwrap_err().class(), FailureClass::ReadTimeout);
    let s = serve(|_, _| {
        vec![
            Step::Write(format!("{SSE_HEAD}{}", content("partial")).into_bytes()),
            Step::Hang,
        ]
    })
    .await;
    let (r, st) = once_with(&short(&s)).await;
    assert_eq!(r.unwrap_err().class(), FailureClass::ReadTimeout);
    assert!(!st.completed);
}

#[tokio::test]
async fn connection_reset_mid_stream() {
    let s = serve(|_, _| {
        vec![
            Step::Write(format!("{SSE_HEAD}{}", content("partial")).into_bytes()),
            Step::Pause(Duration::from_millis(20)),
            Step::Reset,
        ]
    })
    .await;
    let (r, _) = once(&s).await;
    let e = r.unwrap_err();
    assert!(
        matches!(
            e.class(),
            FailureClass::ConnectionReset | FailureClass::IncompleteGeneration
        ),
        "{e:?}"
    );
    assert!(e.is_retryable());
}

#[tokio::test]
async fn unknown_event_type_is_flagged() {
    let s = serve(|_, _| {
        sse(&[
            "event: hosted_tool.started\ndata: {}\n\n".into(),
            content("x"),
        ])
    })
    .await;
    let (r, st) = once(&s).await;
    assert!(r.is_err());
    assert!(st.unknown_event);
}

#[tokio::test]
async fn non_streaming_mode() {
    let s = serve(|i, _| {
        let body = if i == 0 {
            json!({"id":"x","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"whole"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}).to_string()
        } else {
            String::new()
        };
        vec![Step::Write(format!("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()).into_bytes())]
    })
    .await;
    let client = ModelClient::new(ModelConfig {
        stream: false,
        ..s.config()
    })
    .unwrap();
    let c = once_with(&client).await.0.unwrap();
    assert_eq!(c.content, "whole");
    assert_eq!(s.requests.lock().unwrap()[0]["stream"], false);
    assert_eq!(
        once_with(&client).await.0.unwrap_err().class(),
        FailureClass::IncompleteGeneration
    );
}

#[tokio::test]
async fn content_filter_and_refusal() {
    let s = serve(|i, _| if i == 0 { sse(&[content("x"), finish("content_filter"), done()]) } else { sse(&[data(json!({"choices":[{"index":0,"delta":{"refusal":"I can't help"},"finish_reason":null}]})), finish("stop"), done()]) }).await;
    assert_eq!(
        once(&s).await.0.unwrap_err().class(),
        FailureClass::ContentFilter
    );
    assert_eq!(once(&s).await.0.unwrap_err().class(), FailureClass::Refusal);
}
