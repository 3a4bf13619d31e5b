//! A raw HTTP/1.1 test server on a real TCP socket. Each request's response
//! is a script of byte writes, pauses, hangs and resets, so a test controls
//! exactly what the client's socket sees.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use leasehold_model::{ModelClient, ModelConfig};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// One step of a response script.
#[derive(Debug, Clone)]
pub enum Step {
    Write(Vec<u8>),
    Pause(Duration),
    /// Keep the connection open and silent until the client gives up.
    Hang,
    /// Close with a TCP RST.
    Reset,
}

pub type Handler = dyn Fn(usize, &Value) -> Vec<Step> + Send + Sync;

pub struct TestServer {
    pub addr: SocketAddr,
    pub requests: Arc<Mutex<Vec<Value>>>,
    pub count: Arc<AtomicUsize>,
}

impl TestServer {
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }
    pub fn config(&self) -> ModelConfig {
        ModelConfig {
            base_url: self.base_url(),
            model: "test-model".into(),
            connect_timeout: Duration::from_secs(2),
            first_byte_timeout: Duration::from_secs(2),
            idle_timeout: Duration::from_secs(2),
            ..Default::default()
        }
    }
    pub fn client(&self) -> ModelClient {
        ModelClient::new(self.config()).unwrap()
    }
    pub fn hits(&self) -> usize {
        self.count.load(Ordering::SeqCst)
    }
}

pub async fn serve(
    handler: impl Fn(usize, &Value) -> Vec<Step> + Send + Sync + 'static,
) -> TestServer {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let requests = Arc::new(Mutex::new(Vec::new()));
    let count = Arc::new(AtomicUsize::new(0));
    let handler: Arc<Handler> = Arc::new(handler);
    let (r2, c2) = (requests.clone(), count.clone());
    tokio::spawn(async move {
        loop {
            let Ok((sock, _)) = listener.accept().await else {
                return;
            };
            let (h, r, c) = (handler.clone(), r2.clone(), c2.clone());
            tokio::spawn(async move {
                let _ = handle(sock, h, r, c).await;
            });
        }
    });
    TestServer {
        addr,
        requests,
        count,
    }
}

async fn handle(
    mut sock: TcpStream,
    handler: Arc<Handler>,
    requests: Arc<Mutex<Vec<Value>>>,
    count: Arc<AtomicUsize>,
) -> std::io::Result<()> {
    sock.set_nodelay(true)?;
    let mut buf = Vec::new();
    let mut tmp = [0u8; 4096];
    let header_end = loop {
        let n = sock.read(&mut tmp).await?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&tmp[..n]);
        if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break p + 4;
        }
    };
    let head = String::from_utf8_lossy(&buf[..header_end]).to_ascii_lowercase();
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    while buf.len() < header_end + len {
        let n = sock.read(&mut tmp).await?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&tmp[..n]);
    }
    let body: Value = serde_json::from_slice(&buf[header_end..]).unwrap_or(Value::Null);
    let index = count.fetch_add(1, Ordering::SeqCst);
    requests.lock().unwrap().push(body.clone());
    for step in handler(index, &body) {
        match step {
            Step::Write(bytes) => {
                sock.write_all(&bytes).await?;
                sock.flush().await?;
            }
            Step::Pause(d) => tokio::time::sleep(d).await,
            Step::Hang => {
                // Read until the client closes; never answer.
                while sock.read(&mut tmp).await? > 0 {}
                return Ok(());
            }
            Step::Reset => {
                sock.set_zero_linger()?;
                drop(sock);
                return Ok(());
            }
        }
    }
    sock.shutdown().await?;
    Ok(())
}

pub const SSE_HEAD: &str = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\nConnection: close\r\n\r\n";

/// A whole SSE response in one write.
pub fn sse(events: &[String]) -> Vec<Step> {
    let mut body = SSE_HEAD.to_string();
    for e in events {
        body.push_str(e);
    }
    vec![Step::Write(body.into_bytes())]
}

pub fn data(v: Value) -> String {
    format!("data: {v}\n\n")
}

pub fn done() -> String {
    "data: [DONE]\n\n".into()
}

pub fn content(text: &str) -> String {
    data(
        json!({"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":text},"finish_reason":null}]}),
    )
}

pub fn finish(reason: &str) -> String {
    data(
        json!({"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{},"finish_reason":reason}]}),
    )
}

pub fn usage(p: u64, c: u64) -> String {
    data(
        json!({"id":"c","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":p,"completion_tokens":c,"total_tokens":p+c}}),
    )
}

pub fn tool_delta(index: usize, id: Option<&str>, name: Option<&str>, args: &str) -> String {
    let mut tc = json!({"index": index, "function": {"arguments": args}});
    if let Some(id) = id {
        tc["id"] = json!(id);
        tc["type"] = json!("function");
    }
    if let Some(name) = name {
        tc["function"]["name"] = json!(name);
    }
    data(
        json!({"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"tool_calls":[tc]},"finish_reason":null}]}),
    )
}

/// A complete text answer.
pub fn answer(text: &str) -> Vec<Step> {
    sse(&[content(text), finish("stop"), usage(10, 5), done()])
}

/// A complete single tool-call proposal.
pub fn propose(id: &str, name: &str, args: &str) -> Vec<Step> {
    sse(&[
        tool_delta(0, Some(id), Some(name), args),
        finish("tool_calls"),
        usage(10, 5),
        done(),
    ])
}

pub fn status(code: u16, extra_headers: &[(&str, &str)], body: Value) -> Vec<Step> {
    let body = body.to_string();
    let mut head = format!("HTTP/1.1 {code} Error\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n", body.len());
    for (k, v) in extra_headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    head.push_str(&body);
    vec![Step::Write(head.into_bytes())]
}

/// Number of tool results in a request's messages.
pub fn tool_results(body: &Value) -> usize {
    body["messages"]
        .as_array()
        .map_or(0, |m| m.iter().filter(|m| m["role"] == "tool").count())
}
