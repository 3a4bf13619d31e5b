//! The sim's provider modes, text tool protocol, new faults, `/v1/models`
//! and `/stats` fields, through the real binary over a socket.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use serde_json::{json, Value};

/// A running simulator, killed on drop.
struct Sim {
    child: Child,
    addr: String,
    http: reqwest::Client,
}

impl Sim {
    fn start(provider: &str, context_chars: usize) -> Sim {
        let mut child = Command::new(env!("CARGO_BIN_EXE_leasehold-sim"))
            .args(["--listen", "127.0.0.1:0", "--seed", "3"])
            .env("LH_SIM_PROVIDER", provider)
            .env("LH_SIM_CONTEXT_CHARS", context_chars.to_string())
            .env("LH_SIM_TOKEN_DELAY_MS", "0")
            .env_remove("LH_SIM_FAULT_RATE")
            .env_remove("LH_SIM_FAULTS")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("leasehold-sim binary");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = line
            .trim()
            .strip_prefix("listening on ")
            .expect("listening line")
            .to_string();
        Sim {
            child,
            addr,
            http: reqwest::Client::new(),
        }
    }

    /// POSTs `body` to the chat endpoint: status, content-type, body text.
    async fn chat_raw(&self, body: String, fault: Option<&str>) -> (u16, String, String) {
        let mut r = self
            .http
            .post(format!("http://{}/v1/chat/completions", self.addr))
            .header("content-type", "application/json")
            .body(body);
        if let Some(f) = fault {
            r = r.header("x-sim-fault", f);
        }
        let resp = r.send().await.unwrap();
        let status = resp.status().as_u16();
        let ct = resp
            .headers()
            .get("content-type")
            .map(|v| v.to_str().unwrap().to_string())
            .unwrap_or_default();
        (status, ct, resp.text().await.unwrap())
    }

    /// A non-streaming chat: status and JSON body.
    async fn chat(&self, body: Value) -> (u16, Value) {
        let (status, _, text) = self.chat_raw(body.to_string(), None).await;
        (status, serde_json::from_str(&text).unwrap())
    }

    /// A streaming chat: the `data:` payloads that are JSON, and whether
    /// `[DONE]` ended it.
    async fn chat_stream(&self, mut body: Value) -> (Vec<Value>, bool) {
        body["stream"] = json!(true);
        let (status, ct, text) = self.chat_raw(body.to_string(), None).await;
        assert_eq!(status, 200, "{text}");
        assert_eq!(ct, "text/event-stream");
        let datas: Vec<&str> = text
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .collect();
        let done = datas.last() == Some(&"[DONE]");
        let chunks = datas
            .iter()
            .filter(|d| **d != "[DONE]")
            .map(|d| serde_json::from_str(d).unwrap())
            .collect();
        (chunks, done)
    }

    async fn get(&self, path: &str) -> (u16, String, String) {
        let resp = self
            .http
            .get(format!("http://{}{path}", self.addr))
            .send()
            .await
            .unwrap();
        let status = resp.status().as_u16();
        let ct = resp
            .headers()
            .get("content-type")
            .map(|v| v.to_str().unwrap().to_string())
            .unwrap_or_default();
        (status, ct, resp.text().await.unwrap())
    }

    async fn stats(&self) -> Value {
        serde_json::from_str(&self.get("/stats").await.2).unwrap()
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn schema() -> Value {
    json!({"type":"object","required":["title","points"],"properties":{
        "title":{"type":"string"},
        "points":{"type":"array","minItems":2,"maxItems":2,"items":{"type":"string"}}}})
}

fn json_schema_request() -> Value {
    json!({"model":"sim-1","messages":[{"role":"user","content":"Outline leases"}],
        "response_format":{"type":"json_schema","json_schema":{"name":"outline","schema":schema()}}})
}

fn tools_request(stream: bool) -> Value {
    json!({"model":"sim-1","stream":stream,"stream_options":{"include_usage":true},
        "messages":[{"role":"user","content":"Write the section on lease-based ownership."}],
        "tools":[
            {"type":"function","function":{"name":"search","parameters":{"type":"object"}}},
            {"type":"function","function":{"name":"fetch","parameters":{"type":"object"}}}]})
}

fn content(v: &Value) -> &str {
    v.pointer("/choices/0/message/content")
        .and_then(Value::as_str)
        .unwrap_or_else(|| panic!("no content: {v}"))
}

fn conforms(text: &str) {
    let v: Value = serde_json::from_str(text).unwrap();
    assert!(v["title"].is_string(), "{v}");
    assert_eq!(v["points"].as_array().unwrap().len(), 2, "{v}");
}

const LLAMA_REFUSAL: &str = "[{'type': 'literal_error', 'loc': ('body', 'response_format', 'type'), 'msg': \"Input should be 'text' or 'json_object'\", 'input': 'json_schema'}]";

/// A long conversation: about `n` characters of user text.
fn long_request(n: usize) -> Value {
    json!({"model":"sim-1","messages":[
        {"role":"system","content":"You are a research agent."},
        {"role":"user","content":"x ".repeat(n / 2)},
        {"role":"assistant","content":"ok"},
        {"role":"user","content":"Write about leases."}]})
}

#[tokio::test]
async fn openai_answers_structured_output_tools_and_usage() {
    let sim = Sim::start("openai", 0);
    let (s, v) = sim.chat(json_schema_request()).await;
    assert_eq!(s, 200);
    conforms(content(&v));
    let (s, v) = sim
        .chat(json!({"messages":[{"role":"user","content":"hi"}],"response_format":{"type":"json_object"}}))
        .await;
    assert_eq!(s, 200);
    assert_eq!(
        serde_json::from_str::<Value>(content(&v)).unwrap()["ok"],
        true
    );
    // Native tool call, arguments in fragments, then a usage chunk.
    let (chunks, done) = sim.chat_stream(tools_request(true)).await;
    assert!(done);
    let frags = chunks
        .iter()
        .filter(|c| {
            c.pointer("/choices/0/delta/tool_calls/0/function/arguments") == Some(&json!(""))
        })
        .count();
    assert_eq!(frags, 1, "the first tool-call chunk has empty arguments");
    let args: String = chunks
        .iter()
        .filter_map(|c| c.pointer("/choices/0/delta/tool_calls/0/function/arguments"))
        .filter_map(Value::as_str)
        .collect();
    assert_eq!(
        serde_json::from_str::<Value>(&args).unwrap()["q"]
            .as_str()
            .unwrap()
            .split(' ')
            .next(),
        Some("write")
    );
    assert!(chunks.last().unwrap()["usage"]["total_tokens"].as_u64() > Some(0));
    // Bad requests are 400 in OpenAI's envelope.
    let (s, _, body) = sim.chat_raw("{not json".into(), None).await;
    assert_eq!(s, 400);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["code"], "invalid_json");
    assert_eq!(v["error"]["type"], "invalid_request_error");
}

#[tokio::test]
async fn llama_cpp_refuses_json_schema_and_ignores_tools() {
    let sim = Sim::start("llama-cpp", 0);
    let (s, v) = sim.chat(json_schema_request()).await;
    assert_eq!(s, 500);
    assert_eq!(
        v,
        json!({"error":{"message":LLAMA_REFUSAL,"type":"internal_server_error","param":null,"code":null}})
    );
    // Streaming asks are refused the same way, before any event.
    let mut req = json_schema_request();
    req["stream"] = json!(true);
    let (s, ct, _) = sim.chat_raw(req.to_string(), None).await;
    assert_eq!((s, ct.as_str()), (500, "application/json"));

    // json_object with a schema is held to it; without one, a small object.
    let (s, v) = sim
        .chat(
            json!({"messages":[{"role":"user","content":"Outline leases"}],
            "response_format":{"type":"json_object","schema":schema()}}),
        )
        .await;
    assert_eq!(s, 200);
    conforms(content(&v));
    let (s, v) = sim
        .chat(json!({"messages":[{"role":"user","content":"hi"}],"response_format":{"type":"json_object"}}))
        .await;
    assert_eq!(s, 200);
    assert!(serde_json::from_str::<Value>(content(&v))
        .unwrap()
        .is_object());

    // Tools are ignored: prose, never tool calls, streamed or not.
    let (s, v) = sim.chat(tools_request(false)).await;
    assert_eq!(s, 200);
    assert!(v.pointer("/choices/0/message/tool_calls").is_none(), "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert!(content(&v).starts_with("## "));
    let (chunks, _) = sim.chat_stream(tools_request(true)).await;
    assert!(chunks
        .iter()
        .all(|c| c.pointer("/choices/0/delta/tool_calls").is_none()));

    // A body that is not JSON: a 500 of the validation shape.
    let (s, _, body) = sim.chat_raw("{not json".into(), None).await;
    assert_eq!(s, 500);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["type"], "internal_server_error");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .starts_with("[{'type': 'json_invalid', 'loc': ('body', 0), 'msg': 'JSON decode error'"));
    let (s, v) = sim.chat(json!({"model": "sim-1"})).await;
    assert_eq!(s, 500);
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("'loc': ('body', 'messages'), 'msg': 'Field required'"));

    let stats = sim.stats().await;
    assert_eq!(stats["provider"], "llama-cpp");
    assert_eq!(
        stats["response_formats"],
        json!({"json_schema":2,"json_object":1,"json_object_schema":1,"none":2})
    );
    assert_eq!(stats["tools_offered"], 2);
    assert_eq!(stats["tool_calls_proposed"], 0);
}

#[tokio::test]
async fn vllm_takes_structured_output_and_tools_and_errors_at_top_level() {
    let sim = Sim::start("vllm", 0);
    let (s, v) = sim.chat(json_schema_request()).await;
    assert_eq!(s, 200);
    conforms(content(&v));
    let (s, v) = sim.chat(tools_request(false)).await;
    assert_eq!(s, 200);
    assert_eq!(
        v.pointer("/choices/0/message/tool_calls/0/function/name"),
        Some(&json!("search"))
    );
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
    let (s, _, body) = sim.chat_raw("{not json".into(), None).await;
    assert_eq!(s, 400);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["object"], "error");
    assert_eq!(v["type"], "BadRequestError");
    assert_eq!(v["code"], 400);
    assert_eq!(v["param"], Value::Null);
    assert!(v["message"]
        .as_str()
        .unwrap()
        .starts_with("invalid JSON body"));
    assert!(v.get("error").is_none());
}

#[tokio::test]
async fn ollama_sends_whole_tool_calls_and_no_usage() {
    let sim = Sim::start("ollama", 0);
    let (s, v) = sim.chat(json_schema_request()).await;
    assert_eq!(s, 200);
    conforms(content(&v));
    let (chunks, done) = sim.chat_stream(tools_request(true)).await;
    assert!(done);
    let calls: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c.pointer("/choices/0/delta/tool_calls/0"))
        .collect();
    assert_eq!(calls.len(), 1, "one chunk per call: {chunks:?}");
    assert_eq!(calls[0]["function"]["name"], "search");
    assert!(calls[0]["id"].is_string());
    let args: Value =
        serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
    assert!(args["q"].as_str().unwrap().contains("lease"));
    assert!(
        chunks.iter().all(|c| c.get("usage").is_none()),
        "no usage chunk even with include_usage"
    );
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "tool_calls"
    );
    let (s, _, body) = sim.chat_raw("{not json".into(), None).await;
    assert_eq!(s, 400);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert_eq!(v["error"]["param"], Value::Null);
    assert_eq!(v["error"]["code"], Value::Null);
}

#[tokio::test]
async fn context_chars_per_provider() {
    let limit = 400;
    for provider in ["openai", "llama-cpp", "vllm", "ollama"] {
        let sim = Sim::start(provider, limit);
        // Under the limit: a normal answer.
        let (s, _) = sim
            .chat(json!({"messages":[{"role":"user","content":"Write about leases."}]}))
            .await;
        assert_eq!(s, 200, "{provider}");
        let (s, v) = sim.chat(long_request(1000)).await;
        match provider {
            "openai" => {
                assert_eq!(s, 400);
                assert_eq!(v["error"]["code"], "context_length_exceeded");
            }
            "llama-cpp" => {
                assert_eq!(s, 400);
                assert_eq!(v["error"]["code"], "context_length_exceeded");
                assert_eq!(v["error"]["param"], "messages");
                assert_eq!(v["error"]["type"], "invalid_request_error");
                let m = v["error"]["message"].as_str().unwrap();
                assert!(
                    m.starts_with("This model's maximum context length is 100 tokens. However, you requested "),
                    "{m}"
                );
                assert!(
                    m.contains("in the messages, None in the completion)"),
                    "{m}"
                );
            }
            "vllm" => {
                assert_eq!(s, 400);
                assert_eq!(v["object"], "error");
                assert_eq!(v["code"], 400);
                let m = v["message"].as_str().unwrap();
                assert!(
                    m.starts_with("This model's maximum context length is 100 tokens. However, you requested "),
                    "{m}"
                );
            }
            _ => {
                // Ollama truncates silently and answers.
                assert_eq!(s, 200, "{v}");
                assert!(content(&v).starts_with("## Write about leases"), "{v}");
                assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() <= (limit / 4) as u64);
            }
        }
    }
}

/// The text tool protocol's system block, as the runtime writes it.
fn protocol_system() -> String {
    "You are a research agent.\n\nTo call a tool, reply with only lines of the form <tool_call>{\"name\": \"TOOL\", \"arguments\": {...}}</tool_call> and nothing else.\nTools:\n- search: web search. Arguments: {\"q\": string}\n- fetch: fetch a page. Arguments: {\"url\": string}\n".into()
}

#[tokio::test]
async fn text_tool_protocol_plays_search_fetch_section() {
    for provider in ["llama-cpp", "openai"] {
        let sim = Sim::start(provider, 0);
        let mut messages = vec![
            json!({"role":"system","content":protocol_system()}),
            json!({"role":"user","content":"Write the section on lease-based ownership."}),
        ];
        // 1: a search call as text, finish_reason stop (streamed).
        let (chunks, done) = sim
            .chat_stream(json!({"model":"sim-1","messages":messages}))
            .await;
        assert!(done);
        let text: String = chunks
            .iter()
            .filter_map(|c| c.pointer("/choices/0/delta/content"))
            .filter_map(Value::as_str)
            .collect();
        assert_eq!(
            chunks.last().unwrap()["choices"][0]["finish_reason"],
            "stop"
        );
        assert!(chunks
            .iter()
            .all(|c| c.pointer("/choices/0/delta/tool_calls").is_none()));
        assert_eq!(
            text,
            "<tool_call>{\"name\": \"search\", \"arguments\": {\"q\": \"write the section on lease-based ownership\"}}</tool_call>",
            "{provider}"
        );
        messages.push(json!({"role":"assistant","content":text}));
        messages.push(json!({"role":"user","content":format!("<tool_result name=\"search\">{}</tool_result>",
            json!({"results":[{"title":"Leases","url":"http://example.test/page/leases","content":"..."}]}))}));
        // 2: a fetch of the first result's URL.
        let (s, v) = sim.chat(json!({"model":"sim-1","messages":messages})).await;
        assert_eq!(s, 200);
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        let fetch = content(&v).to_string();
        assert_eq!(
            fetch,
            "<tool_call>{\"name\": \"fetch\", \"arguments\": {\"url\": \"http://example.test/page/leases\"}}</tool_call>"
        );
        messages.push(json!({"role":"assistant","content":fetch}));
        messages.push(json!({"role":"user","content":"<tool_result name=\"fetch\">\nLeases expire; fencing tokens refuse stale writers.\n</tool_result>"}));
        // 3: the section, citing the fetched URL.
        let (s, v) = sim.chat(json!({"model":"sim-1","messages":messages})).await;
        assert_eq!(s, 200);
        let section = content(&v);
        assert!(section.starts_with("## Write the section"), "{section}");
        assert!(section.contains("http://example.test/page/leases"));
        let stats = sim.stats().await;
        assert_eq!(stats["text_tool_calls"], 2);
        assert_eq!(stats["tools_offered"], 0);
        assert_eq!(stats["tool_calls_by_name"], json!({"search":1,"fetch":1}));
    }
}

#[tokio::test]
async fn new_fault_kinds_have_their_shapes() {
    for provider in ["openai", "vllm"] {
        let sim = Sim::start(provider, 0);
        let body = json!({"stream":true,"messages":[{"role":"user","content":"hi"}]}).to_string();
        let (s, ct, text) = sim.chat_raw(body.clone(), Some("html")).await;
        assert_eq!(s, 200);
        assert!(ct.starts_with("text/html"), "{ct}");
        assert!(text.starts_with("<!DOCTYPE html>") && text.contains("</html>"));
        let (s, ct, text) = sim.chat_raw(body.clone(), Some("not_found")).await;
        assert_eq!((s, ct.as_str()), (404, "application/json"));
        assert_eq!(
            serde_json::from_str::<Value>(&text).unwrap(),
            json!({"detail":"Not Found"})
        );
        let (s, _, text) = sim.chat_raw(body.clone(), Some("unauthorized")).await;
        assert_eq!(s, 401);
        assert_eq!(
            serde_json::from_str::<Value>(&text).unwrap(),
            json!({"error":{"message":"Incorrect API key provided","type":"invalid_request_error","code":"invalid_api_key"}})
        );
        let (s, _, text) = sim.chat_raw(body, Some("invalid_request_500")).await;
        assert_eq!(s, 500);
        assert_eq!(
            serde_json::from_str::<Value>(&text).unwrap(),
            json!({"error":{"message":LLAMA_REFUSAL,"type":"internal_server_error","param":null,"code":null}})
        );
        let stats = sim.stats().await;
        assert_eq!(
            stats["faults"],
            json!({"html":1,"not_found":1,"unauthorized":1,"invalid_request_500":1})
        );
    }
}

#[tokio::test]
async fn models_unknown_paths_and_stats_fields() {
    let sim = Sim::start("openai", 0);
    let (s, _, text) = sim.get("/v1/models").await;
    assert_eq!(s, 200);
    assert_eq!(
        serde_json::from_str::<Value>(&text).unwrap(),
        json!({"object":"list","data":[{"id":"sim-1","object":"model","owned_by":"leasehold-sim"}]})
    );
    let (s, _, text) = sim.get("/v1/nothing").await;
    assert_eq!(s, 404);
    assert_eq!(
        serde_json::from_str::<Value>(&text).unwrap()["error"]["message"],
        "Invalid URL (GET /v1/nothing)"
    );
    sim.chat(json_schema_request()).await;
    sim.chat(tools_request(false)).await;
    let stats = sim.stats().await;
    assert_eq!(stats["provider"], "openai");
    assert_eq!(
        stats["response_formats"],
        json!({"json_schema":1,"json_object":0,"json_object_schema":0,"none":1})
    );
    assert_eq!(stats["tools_offered"], 1);
    assert_eq!(stats["text_tool_calls"], 0);
    assert_eq!(stats["tool_calls_proposed"], 1);
    assert_eq!(stats["chat_requests"], 2);

    for (provider, ct, body) in [
        (
            "llama-cpp",
            "application/json",
            "{\"detail\":\"Not Found\"}",
        ),
        ("vllm", "application/json", "{\"detail\":\"Not Found\"}"),
        ("ollama", "text/plain", "404 page not found"),
    ] {
        let sim = Sim::start(provider, 0);
        let (s, got_ct, text) = sim.get("/v1/nothing").await;
        assert_eq!((s, got_ct.as_str(), text.as_str()), (404, ct, body));
    }
}

#[test]
fn unknown_provider_is_an_error_at_start() {
    let out = Command::new(env!("CARGO_BIN_EXE_leasehold-sim"))
        .args(["--listen", "127.0.0.1:0", "--provider", "tgi"])
        .env_remove("LH_SIM_PROVIDER")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(out.stdout.is_empty(), "never listened");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("invalid value 'tgi' for '--provider"), "{err}");
    assert!(
        err.contains("openai, llama-cpp, vllm, ollama"),
        "names the modes: {err}"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_leasehold-sim"))
        .args(["--listen", "127.0.0.1:0"])
        .env("LH_SIM_PROVIDER", "tgi")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("'tgi'"));
}

/// A limit set at run time (`POST /limits`) is enforced: the request over
/// it gets 429 with `Retry-After` in the form asked for, and `/stats`
/// counts it by limit.
#[tokio::test]
async fn limits_answer_429_with_retry_after_in_either_form() {
    let sim = Sim::start("openai", 0);
    let set = |body: Value| {
        let http = sim.http.clone();
        let url = format!("http://{}/limits", sim.addr);
        async move { http.post(url).json(&body).send().await.unwrap() }
    };
    let bad = set(json!({"model": "sim-1", "rpm": 0})).await;
    assert_eq!(bad.status().as_u16(), 400);
    assert!(bad.text().await.unwrap().contains("rpm"));
    let ok =
        set(json!({"model": "sim-1", "rpm": 60, "burst": 2, "retry_after_form": "seconds"})).await;
    assert_eq!(ok.status().as_u16(), 200);
    let req = || json!({"model": "sim-1", "messages": [{"role": "user", "content": "hello"}]});
    let send = || {
        sim.http
            .post(format!("http://{}/v1/chat/completions", sim.addr))
            .json(&req())
            .send()
    };
    for _ in 0..2 {
        assert_eq!(send().await.unwrap().status().as_u16(), 200);
    }
    let refused = send().await.unwrap();
    assert_eq!(refused.status().as_u16(), 429);
    let ra = refused.headers()["retry-after"]
        .to_str()
        .unwrap()
        .to_string();
    assert_eq!(ra, "1", "seconds form, rounded up");

    set(json!({"model": "sim-1", "rpm": 60, "burst": 1, "retry_after_form": "http_date"})).await;
    let _ = send().await.unwrap();
    let refused = send().await.unwrap();
    assert_eq!(refused.status().as_u16(), 429);
    let ra = refused.headers()["retry-after"]
        .to_str()
        .unwrap()
        .to_string();
    assert!(ra.ends_with(" GMT"), "HTTP-date form: {ra}");

    let stats = sim.stats().await;
    assert_eq!(stats["rate_limited"]["requests"], 2);
    assert_eq!(stats["rate_limited_total"], 2);
    // Removing the limits lets everything through again.
    set(json!({"model": "sim-1"})).await;
    assert_eq!(send().await.unwrap().status().as_u16(), 200);
}
