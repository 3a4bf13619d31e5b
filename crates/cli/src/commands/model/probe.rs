//! The capability probes: each one request in one forced form, judged from
//! what came back.

use std::time::Duration;

use futures::StreamExt;
use tokio::time::Instant;

use leasehold_model::{
    function_tool, AttemptState, BreakerConfig, Budget, ChatRequest, Completion, Delta,
    FailureClass, GenerationPolicy, Generator, ModelClient, ModelConfig, ModelError, RunContext,
    StructuredMode, ToolsMode,
};
use leasehold_transcript::Message;
use serde::Serialize;
use serde_json::{json, Value};

/// One probe's answer.
#[derive(Debug, Clone, Serialize)]
pub struct Probe {
    /// `supported`, `unsupported` (refused, or answered without it),
    /// `failed` (no answer to judge: an outage, a timeout), `skipped`;
    /// the concurrency probe's: `parallel`, `serialized`, `interrupts`.
    pub status: &'static str,
    pub detail: String,
    /// The setting to use, when one is advised.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub set: Option<String>,
}

impl Probe {
    fn of(status: &'static str, detail: impl Into<String>) -> Probe {
        Probe {
            status,
            detail: detail.into(),
            set: None,
        }
    }
    fn supported(&self) -> bool {
        self.status == "supported"
    }
    fn skipped() -> Probe {
        Probe::of("skipped", "not asked for (--probe)")
    }
    /// A request that failed: refused (the provider will not take it)
    /// or failed (nothing to judge).
    fn of_error(e: &ModelError) -> Probe {
        let m = e.to_string();
        let refused_form = m.contains("LH_MODEL_STRUCTURED") || m.contains("LH_MODEL_TOOLS");
        match e.class() {
            FailureClass::BadRequest => Probe::of("unsupported", format!("refused: {m}")),
            FailureClass::Config if refused_form => {
                Probe::of("unsupported", format!("refused: {m}"))
            }
            _ => Probe::of("failed", m),
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Structured {
    pub json_schema: Probe,
    pub json_object: Probe,
    pub prompt: Probe,
}

#[derive(Debug, Clone, Serialize)]
pub struct Tools {
    pub native: Probe,
    pub parallel: Probe,
    pub text: Probe,
}

#[derive(Debug, Clone, Serialize)]
pub struct Capabilities {
    pub streaming_usage: Probe,
    pub structured: Structured,
    pub tools: Tools,
    pub context_error: Probe,
    /// How many requests the server serves at once.
    pub concurrency: Probe,
}

/// Whether research runs here as configured, and how.
#[derive(Debug, Clone, Serialize)]
pub struct Workload {
    pub kind: &'static str,
    pub runs: bool,
    pub structured_form: Option<&'static str>,
    pub tools_form: &'static str,
    /// Settings that would make it run (or run better).
    pub set: Vec<String>,
    pub why: String,
}

async fn ask(cfg: &ModelConfig, req: ChatRequest) -> Result<Completion, ModelError> {
    let client = ModelClient::new(cfg.clone())?;
    let g = Generator::new(
        client,
        GenerationPolicy {
            max_attempts: 2,
            ..Default::default()
        },
        BreakerConfig::default(),
    );
    let mut ctx = RunContext::new(Budget::unlimited());
    ctx.deadline = Some(tokio::time::Instant::now() + Duration::from_secs(60));
    g.generate(&req, &ctx, &mut vec![])
        .await
        .map(|g| g.completion)
        .map_err(|f| f.error)
}

fn schema() -> Value {
    json!({"type": "object",
        "properties": {"title": {"type": "string"}, "points": {"type": "array", "items": {"type": "string"}, "minItems": 2, "maxItems": 3}},
        "required": ["title", "points"], "additionalProperties": false})
}

/// Whether `text` is a JSON object with the schema's required keys.
fn matches_schema(text: &str) -> Result<(), String> {
    let v: Value =
        serde_json::from_str(text.trim()).map_err(|e| format!("not JSON ({e}): {text:.120}"))?;
    let o = v.as_object().ok_or("not a JSON object")?;
    for k in ["title", "points"] {
        if !o.contains_key(k) {
            return Err(format!("missing {k:?}: {text:.120}"));
        }
    }
    Ok(())
}

async fn structured(cfg: &ModelConfig, mode: StructuredMode) -> Probe {
    let cfg = ModelConfig {
        structured: mode,
        ..cfg.clone()
    };
    let req = ChatRequest {
        messages: vec![
            Message::system("You answer with JSON."),
            Message::user("Give a title and two short points about leases."),
        ],
        response_format: Some(
            json!({"type": "json_schema", "json_schema": {"name": "probe", "strict": true, "schema": schema()}}),
        ),
        max_tokens: Some(200),
        ..Default::default()
    };
    match ask(&cfg, req).await {
        Ok(c) => match matches_schema(&c.content) {
            Ok(()) => Probe::of("supported", "valid JSON matching the schema"),
            Err(why) => Probe::of("unsupported", format!("answered, but {why}")),
        },
        Err(e) => Probe::of_error(&e),
    }
}

/// The research workload's own search tool (the one its sections call).
fn search_tool() -> Value {
    function_tool(
        "search",
        "Search the web.",
        json!({"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}),
    )
}

async fn tools(cfg: &ModelConfig, mode: ToolsMode, prompt: &str, want: usize) -> Probe {
    let cfg = ModelConfig {
        tools: mode,
        ..cfg.clone()
    };
    let req = ChatRequest {
        messages: vec![
            Message::system("You call tools when asked."),
            Message::user(prompt),
        ],
        tools: vec![search_tool()],
        max_tokens: Some(200),
        ..Default::default()
    };
    match ask(&cfg, req).await {
        Ok(c) => {
            let calls = c
                .tool_calls
                .iter()
                .filter(|t| t.function.name == "search")
                .count();
            if calls >= want {
                Probe::of(
                    "supported",
                    format!("{calls} search call(s) in one response"),
                )
            } else if calls > 0 {
                Probe::of(
                    "unsupported",
                    format!("{calls} call(s) where {want} were asked for"),
                )
            } else {
                Probe::of(
                    "unsupported",
                    format!("answered without calling the tool: {:.120}", c.content),
                )
            }
        }
        Err(e) => Probe::of_error(&e),
    }
}

async fn streaming_usage(cfg: &ModelConfig) -> Probe {
    if !cfg.stream {
        return Probe::of("skipped", "LH_MODEL_STREAM=false");
    }
    let req = ChatRequest {
        messages: vec![Message::user("Say ok.")],
        max_tokens: Some(16),
        ..Default::default()
    };
    match ask(cfg, req).await {
        Ok(c) if !c.usage.estimated => Probe::of(
            "supported",
            format!("{} prompt + {} completion tokens", c.usage.prompt_tokens, c.usage.completion_tokens),
        ),
        Ok(_) => Probe::of(
            "unsupported",
            "the stream completed without a usage chunk: token budgets use an estimate (4 characters a token)",
        ),
        Err(e) => Probe::of_error(&e),
    }
}

async fn context_error(cfg: &ModelConfig, chars: usize) -> Probe {
    let filler = "lease ".repeat(chars / 6 + 1);
    let req = ChatRequest {
        messages: vec![Message::user(format!("{filler}\nSay ok."))],
        max_tokens: Some(8),
        ..Default::default()
    };
    match ask(cfg, req).await {
        Err(e) if e.class() == FailureClass::ContextExceeded => Probe::of(
            "supported",
            format!("a {chars}-character prompt is refused as context_exceeded: warm retries compact"),
        ),
        Err(e) => Probe::of(
            "unsupported",
            format!("a {chars}-character prompt failed as {}, not as a context error ({e}): a section whose context overflows is retried as that failure, not compacted", e.class()),
        ),
        Ok(_) => Probe::of(
            "unsupported",
            format!("a {chars}-character prompt was answered: the provider truncates silently (or its window is larger)"),
        ),
    }
}

/// One stream's tokens (when each came), finish reason and end.
struct Seen {
    tokens: Vec<Instant>,
    finish: Option<String>,
    /// The server ended the stream itself (`[DONE]`).
    done: bool,
    ended: Instant,
    error: Option<String>,
}
/// Reads one answer's stream, telling `on_first` at its first token.
async fn read(
    client: &ModelClient,
    req: &ChatRequest,
    model: &str,
    mut on_first: Option<tokio::sync::oneshot::Sender<()>>,
) -> Seen {
    let mut seen = Seen {
        tokens: Vec::new(),
        finish: None,
        done: false,
        ended: Instant::now(),
        error: None,
    };
    let mut st = AttemptState::default();
    match client.stream(req, model, &mut st).await {
        Err(e) => seen.error = Some(e.to_string()),
        Ok(mut s) => {
            while let Some(d) = s.next().await {
                match d {
                    Ok(Delta::Content(t)) if !t.is_empty() => {
                        seen.tokens.push(Instant::now());
                        if let Some(tx) = on_first.take() {
                            let _ = tx.send(());
                        }
                    }
                    Ok(Delta::ToolCall { .. }) => seen.tokens.push(Instant::now()),
                    Ok(Delta::Finish(r)) => seen.finish = Some(r),
                    Ok(Delta::Done) => {
                        seen.done = true;
                        break;
                    }
                    Ok(_) => {}
                    Err(e) => {
                        seen.error = Some(e.to_string());
                        break;
                    }
                }
            }
        }
    }
    seen.ended = Instant::now();
    seen
}

/// What the two streams' times say: `parallel`, `serialized`,
/// `interrupts`, or `failed` with why nothing can be judged.
fn judge(a: &Seen, sent: Instant, b: &Seen) -> Probe {
    let ms = |d: Duration| d.as_millis();
    let after = a.tokens.iter().filter(|t| **t > sent).count();
    let one_at_a_time = Some("LH_MODEL_CONCURRENCY=1".to_string());
    if a.finish.is_none() && a.done && a.ended >= sent {
        return Probe {
            status: "interrupts",
            detail: format!(
                "the server ended the first stream ([DONE]) before its finish reason {} ms after a second request was sent ({} tokens in, {after} after), and the second {}: it serves one request at a time and cuts the one in flight for a newcomer (llama-cpp-python's interrupt_requests)",
                ms(a.ended - sent),
                a.tokens.len(),
                match (&b.finish, &b.error) {
                    (Some(_), _) => "was then answered".to_string(),
                    (None, Some(e)) => format!("failed: {e}"),
                    (None, None) => "ended without a finish reason too".to_string(),
                }
            ),
            set: one_at_a_time,
        };
    }
    if let Some(e) = a.error.as_ref().or(b.error.as_ref()) {
        return Probe::of("failed", format!("a request failed: {e}"));
    }
    if a.finish.is_none() {
        return Probe::of(
            "failed",
            "the first stream stopped without a finish reason or [DONE]: nothing to judge",
        );
    }
    let Some(b_first) = b.tokens.first().copied() else {
        return Probe::of("failed", "the second answer had no token: nothing to judge");
    };
    // Judged by the tokens' times, not by when this process read each
    // stream's end (it reads the two connections in either order).
    let overlap = a.tokens.iter().filter(|t| **t > b_first).count();
    if overlap >= 2 {
        return Probe::of(
            "parallel",
            format!(
                "the second request's first token came {} ms after it was sent, while the first still streamed ({overlap} of its tokens came after)",
                ms(b_first - sent)
            ),
        );
    }
    if after < 3 {
        return Probe::of(
            "failed",
            format!(
                "the first answer ended {} ms after the second request was sent ({after} tokens after it): too soon to tell",
                ms(a.ended.saturating_duration_since(sent))
            ),
        );
    }
    let a_last = a.tokens.last().copied().unwrap_or(sent);
    Probe {
        status: "serialized",
        detail: format!(
            "the second request's first token came {} ms after it was sent, {} ms after the first answer's last ({after} tokens streamed meanwhile): the server serves one request at a time and queues the others",
            ms(b_first - sent),
            ms(b_first.saturating_duration_since(a_last))
        ),
        set: one_at_a_time,
    }
}

/// How the server serves two requests at once: a long answer streamed,
/// and once its first token came a second, short one. The second's
/// first token while the first still streams (tokens of the first come
/// after it): `parallel`; only after the first's last token:
/// `serialized` (it waited); the first's stream ended
/// before its finish reason once the second was sent: `interrupts`
/// (llama-cpp-python's `interrupt_requests`: research's experts would
/// cut each other's sections).
async fn concurrency(cfg: &ModelConfig) -> Probe {
    let cfg = ModelConfig {
        stream: true,
        ..cfg.clone()
    };
    let client = match ModelClient::new(cfg.clone()) {
        Ok(c) => c,
        Err(e) => return Probe::of_error(&e),
    };
    let long = ChatRequest {
        messages: vec![Message::user(
            "Write a long story about a lighthouse keeper and the ships she watches, in at least four paragraphs.",
        )],
        max_tokens: Some(256),
        ..Default::default()
    };
    let short = ChatRequest {
        messages: vec![Message::user("Say ok.")],
        max_tokens: Some(8),
        ..Default::default()
    };
    let (tx, rx) = tokio::sync::oneshot::channel();
    let model = cfg.model.clone();
    let first = read(&client, &long, &model, Some(tx));
    let second = async {
        rx.await.ok()?;
        let sent = Instant::now();
        Some((sent, read(&client, &short, &model, None).await))
    };
    let Ok((a, b)) = tokio::time::timeout(
        Duration::from_secs(120),
        futures::future::join(first, second),
    )
    .await
    else {
        return Probe::of("failed", "the two requests did not end within 120 s");
    };
    let Some((sent, b)) = b else {
        return Probe::of(
            "failed",
            match a.error {
                Some(e) => format!("the first request failed before its first token: {e}"),
                None => "the first answer had no token: nothing to judge".into(),
            },
        );
    };
    judge(&a, sent, &b)
}

pub async fn all(
    cfg: &ModelConfig,
    want: &dyn Fn(&str) -> bool,
    context_chars: usize,
) -> Capabilities {
    let skip = Probe::skipped;
    let structured_p = want("structured");
    let tools_p = want("tools");
    Capabilities {
        streaming_usage: if want("streaming_usage") {
            streaming_usage(cfg).await
        } else {
            skip()
        },
        structured: Structured {
            json_schema: if structured_p {
                structured(cfg, StructuredMode::JsonSchema).await
            } else {
                skip()
            },
            json_object: if structured_p {
                structured(cfg, StructuredMode::JsonObject).await
            } else {
                skip()
            },
            prompt: if structured_p {
                structured(cfg, StructuredMode::Prompt).await
            } else {
                skip()
            },
        },
        tools: Tools {
            native: if tools_p {
                tools(
                    cfg,
                    ToolsMode::Native,
                    "Find sources on commercial leases: call the search tool.",
                    1,
                )
                .await
            } else {
                skip()
            },
            parallel: if tools_p {
                tools(cfg, ToolsMode::Native, "Call the search tool twice in this one reply: once for commercial leases, once for residential leases.", 2).await
            } else {
                skip()
            },
            text: if tools_p {
                tools(
                    cfg,
                    ToolsMode::Text,
                    "Find sources on commercial leases: call the search tool.",
                    1,
                )
                .await
            } else {
                skip()
            },
        },
        context_error: if want("context_error") {
            context_error(cfg, context_chars).await
        } else {
            skip()
        },
        concurrency: if want("concurrency") {
            concurrency(cfg).await
        } else {
            skip()
        },
    }
}

/// The research workload's verdict: it needs a structured-output form
/// (outline, perspectives) and the plain generation; tools make its
/// sections better but it runs without them (the report says so).
pub fn workload(cfg: &ModelConfig, caps: &Capabilities, generation_ok: bool) -> Workload {
    let s = &caps.structured;
    let forms = [
        ("json_schema", &s.json_schema),
        ("json_object", &s.json_object),
        ("prompt", &s.prompt),
    ];
    let first_ok = forms.iter().find(|(_, p)| p.supported()).map(|(n, _)| *n);
    let probed = forms.iter().any(|(_, p)| p.status != "skipped");
    let mut set = Vec::new();
    let mut why = Vec::new();
    let structured_form = match cfg.structured {
        StructuredMode::Auto => first_ok,
        forced => {
            let name = match forced {
                StructuredMode::JsonSchema => "json_schema",
                StructuredMode::JsonObject => "json_object",
                _ => "prompt",
            };
            let p = forms.iter().find(|(n, _)| *n == name).map(|(_, p)| *p);
            if p.is_some_and(|p| p.supported()) || !probed {
                Some(name)
            } else {
                why.push(format!("LH_MODEL_STRUCTURED={name} is not supported here"));
                match first_ok {
                    Some(ok) => set.push(format!("LH_MODEL_STRUCTURED={ok}")),
                    None => set.push("LH_MODEL_STRUCTURED=auto".into()),
                }
                None
            }
        }
    };
    if probed && first_ok.is_none() {
        why.push(
            "no structured-output form gives valid JSON (outline and perspectives need one)".into(),
        );
    }
    let t = &caps.tools;
    let tools_form = match cfg.tools {
        ToolsMode::None => "none",
        ToolsMode::Text => "text",
        ToolsMode::Native => {
            if t.native.status == "unsupported" {
                set.push("LH_MODEL_TOOLS=auto".into());
                why.push("LH_MODEL_TOOLS=native: the provider does not call tools natively".into());
            }
            "native"
        }
        ToolsMode::Auto => {
            if t.native.supported() || t.native.status == "skipped" {
                "native"
            } else if t.text.supported() {
                set.push("LH_MODEL_TOOLS=text".into());
                "text"
            } else {
                "none (sections are written without search and fetch)"
            }
        }
    };
    if !generation_ok {
        why.insert(0, "the plain generation did not complete".into());
    }
    // How many requests at once: what research's experts, in parallel,
    // would meet. Notes do not stop the workload; a concurrency set by
    // hand above 1 on a server that cuts streams does (sections lost).
    let mut notes = Vec::new();
    let c = &caps.concurrency;
    let one = "LH_MODEL_CONCURRENCY=1".to_string();
    match (c.status, cfg.concurrency) {
        (_, Some(1)) | ("parallel" | "failed" | "skipped", _) => {}
        ("interrupts", Some(n)) => {
            why.push(format!(
                "the server serves one request at a time and cuts the stream in flight for a newcomer, but LH_MODEL_CONCURRENCY={n}: research's experts would cut each other's streams and lose sections"
            ));
            set.push(one);
        }
        ("interrupts", None) => {
            notes.push(
                "the server serves one request at a time and cuts the stream in flight for a newcomer (llama-cpp-python's interrupt_requests): research's experts in parallel would cut each other's sections; workers learn a concurrency of 1 from the first two cuts (a worker that sends one request at a time never sees one): start with it set, or run the server so it queues (--interrupt_requests false)"
                    .to_string(),
            );
            set.push(one);
        }
        (_, _) => {
            notes.push(
                "the server serves one request at a time (a second request waits for the first): research's experts take turns; with a concurrency of 1 they wait in the worker rather than against LH_MODEL_FIRST_BYTE_TIMEOUT"
                    .to_string(),
            );
            set.push(one);
        }
    }
    let runs = generation_ok
        && !why.iter().any(|w| !w.starts_with("LH_MODEL_TOOLS"))
        && !(cfg.tools == ToolsMode::Native && t.native.status == "unsupported");
    why.extend(notes);
    Workload {
        kind: "research",
        runs,
        structured_form,
        tools_form,
        why: if why.is_empty() {
            "runs as configured".into()
        } else {
            format!(
                "{}{}",
                why.join("; "),
                if set.is_empty() {
                    String::new()
                } else {
                    format!("; set {}", set.join(" "))
                }
            )
        },
        set,
    }
}
