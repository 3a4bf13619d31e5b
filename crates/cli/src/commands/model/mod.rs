//! `leasehold model check`: one request to the configured provider through
//! the same client and generation retry layer the workers use, then probes
//! of what the research workload needs (streaming with usage, each
//! structured-output form, native and parallel tool calls, the text tool
//! protocol, the context-length error, and how many requests the server
//! serves at once: two overlapping streams), reported as JSON on stdout.
//!
//! Reads `LH_MODEL_BASE_URL`, `LH_MODEL`, `LH_API_KEY` and the other
//! `LH_MODEL_*` variables (see `leasehold_model::ModelConfig`). Exit 0 when
//! the generation completed and the workload can run on this provider as
//! configured, 1 otherwise (with a line on stderr saying what to set).

use std::sync::Arc;
use std::time::{Duration, Instant};

use leasehold_model::{
    function_tool, BreakerConfig, Budget, ChatRequest, CollectingReporter, FailureClass,
    GenerationPolicy, Generator, ModelClient, ModelConfig, RunContext,
};
use leasehold_store::NatsArgs;
use leasehold_transcript::Message;
use serde_json::json;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(clap::Subcommand, Debug)]
enum Cmd {
    /// Send a short prompt, probe what the workload needs, and report how
    /// the provider behaved (JSON).
    ///
    /// The report has: outcome (complete|incomplete|error), failure class,
    /// each retry with its report, latency to first token and in all, token
    /// usage; `capabilities`: each probe's status (supported, unsupported,
    /// failed, skipped) and detail, and `concurrency` (parallel, serialized:
    /// a second request waits for the first, interrupts: a second request
    /// cuts the first's stream) with the setting to use; `workload`: whether research runs here
    /// as configured, in which forms, and what to set if not. Exit 0 when
    /// the generation completed and the workload runs, 1 otherwise.
    Check(CheckArgs),
}

#[derive(clap::Args, Debug)]
struct CheckArgs {
    /// The prompt to send.
    #[arg(long, default_value = "Reply with one short sentence about leases.")]
    prompt: String,
    /// Offer the research tools (search, fetch) so the model may call them.
    #[arg(long)]
    tools: bool,
    /// Use a non-streaming request.
    #[arg(long)]
    no_stream: bool,
    /// Generation attempts, including the first.
    #[arg(long, default_value_t = 3)]
    attempts: u32,
    /// Give up after this long in all (e.g. `30s`).
    #[arg(long, default_value = "60s", value_parser = leasehold_core::time::parse_duration)]
    deadline: Duration,
    /// Override LH_MODEL_BASE_URL.
    #[arg(long)]
    base_url: Option<String>,
    /// Override LH_MODEL.
    #[arg(long)]
    model: Option<String>,
    /// Only the one request: no capability probes.
    #[arg(long)]
    no_probe: bool,
    /// Probes to run, comma-separated: streaming_usage, structured, tools,
    /// context_error, concurrency [default: all].
    #[arg(long, value_delimiter = ',', value_parser = ["streaming_usage", "structured", "tools", "context_error", "concurrency"])]
    probe: Vec<String>,
    /// Characters of the prompt sent to provoke the context-length error
    /// (beyond any window the model has: the provider should refuse it
    /// before generating anything).
    #[arg(long, default_value_t = 600_000)]
    context_probe_chars: usize,
    #[command(flatten)]
    json: super::AlwaysJson,
}

pub async fn run(args: Args, _nats: &NatsArgs) -> anyhow::Result<i32> {
    match args.cmd {
        Cmd::Check(a) => check(a).await,
    }
}

async fn check(a: CheckArgs) -> anyhow::Result<i32> {
    let mut cfg = ModelConfig::from_env()?;
    if let Some(u) = a.base_url {
        cfg.base_url = u;
    }
    if let Some(m) = a.model {
        cfg.model = m;
    }
    cfg.stream = cfg.stream && !a.no_stream;
    let (base_url, model, stream) = (cfg.base_url.clone(), cfg.model.clone(), cfg.stream);
    let probe_cfg = cfg.clone();
    let policy = GenerationPolicy {
        max_attempts: a.attempts.max(1),
        ..Default::default()
    };
    let generator = Generator::new(ModelClient::new(cfg)?, policy, BreakerConfig::default());
    let mut ctx = RunContext::new(Budget::unlimited());
    let reporter = Arc::new(CollectingReporter::default());
    ctx.reporter = reporter.clone();
    ctx.deadline = Some(tokio::time::Instant::now() + a.deadline);
    let tools = if a.tools {
        vec![
            function_tool(
                "search",
                "Search the web.",
                json!({"type":"object","properties":{"query":{"type":"string"}},"required":["query"]}),
            ),
            function_tool(
                "fetch",
                "Fetch a web page.",
                json!({"type":"object","properties":{"url":{"type":"string"}},"required":["url"]}),
            ),
        ]
    } else {
        vec![]
    };
    let req = ChatRequest {
        messages: vec![Message::user(a.prompt)],
        tools,
        ..Default::default()
    };
    let started = Instant::now();
    let mut reports = Vec::new();
    let result = generator.generate(&req, &ctx, &mut reports).await;
    let total_ms = started.elapsed().as_millis() as u64;
    let (report, code) = match result {
        Ok(g) => (
            json!({
                "outcome": "complete",
                "class": null,
                "finish_reason": g.completion.finish_reason,
                "content": g.completion.content,
                "tool_calls": g.completion.tool_calls,
                "attempts": g.attempts,
                "fallback_used": g.fallback_used,
                "latency_ms": {"first_token": g.completion.first_token.map(|d| d.as_millis() as u64), "total": total_ms},
                "usage": g.completion.usage,
                "done_seen": g.completion.done_seen,
            }),
            0,
        ),
        Err(f) => {
            let class = f.error.class();
            let outcome = if class == FailureClass::IncompleteGeneration {
                "incomplete"
            } else {
                "error"
            };
            (
                json!({
                    "outcome": outcome,
                    "class": class,
                    "error": f.error.to_string(),
                    "retryable": class.is_retryable(),
                    "ineligible": f.ineligible,
                    "attempts": f.attempts,
                    "latency_ms": {"first_token": null, "total": total_ms},
                    "usage": null,
                }),
                1,
            )
        }
    };
    let mut report = report;
    report["provider"] = json!({"base_url": base_url, "model": model, "stream": stream});
    report["retries"] = serde_json::to_value(reporter.take())?;
    let mut code = code;
    if !a.no_probe {
        let want = |p: &str| a.probe.is_empty() || a.probe.iter().any(|x| x == p);
        let caps = probe::all(&probe_cfg, &want, a.context_probe_chars).await;
        let verdict = probe::workload(&probe_cfg, &caps, code == 0);
        if !verdict.runs {
            eprintln!(
                "research cannot run on this provider as configured: {}",
                verdict.why
            );
            code = 1;
        }
        report["capabilities"] = serde_json::to_value(&caps)?;
        report["workload"] = serde_json::to_value(&verdict)?;
    }
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(code)
}

mod probe;
