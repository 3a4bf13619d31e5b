//! `leasehold-worker`: the stateless worker binary. See `leasehold-worker --help`.
//!
//! Everything the process will ever read from its environment is read and
//! validated here, before it connects: the flags (each with its `LH_<FLAG>`
//! variable) and the workload's variables (model, tools, research). A bad
//! value stops the process with exit code 2 and a message naming the
//! variable, instead of failing every job later.
//!
//! Logs go to stderr (`LH_LOG_FORMAT=json|text`, `RUST_LOG`); traces to an
//! OTLP/gRPC collector when `OTEL_EXPORTER_OTLP_ENDPOINT` is set; with
//! `--http-listen` (`LH_HTTP_LISTEN`), `/healthz`, `/readyz` and `/metrics`.

use std::sync::Arc;

use clap::{CommandFactory, FromArgMatches};
use leasehold_research::ResearchConfig;
use leasehold_telemetry::{redact_text, trace};
use leasehold_worker::research::ResearchHandler;
use leasehold_worker::{Options, Worker};

/// Exit code of a configuration error found at start (as clap's usage errors).
const CONFIG_ERROR: i32 = 2;

/// The `--help` section listing the variables that are not flags.
fn env_help() -> String {
    let mut s = String::from(
        "Workload variables (not flags; read and validated at start, a bad value stops the worker).\n\
         Durations need a unit: 500ms, 3s, 2m.\n",
    );
    let sections: [(&str, &[(&str, &str)]); 3] = [
        ("Model (research)", leasehold_model::MODEL_ENV_VARS),
        ("Tools (research, deliver)", leasehold_tools::TOOL_ENV_VARS),
        ("Research", leasehold_research::ENV_VARS),
    ];
    for (title, vars) in sections {
        s.push_str(&format!("\n{title}:\n"));
        for (name, what) in vars {
            s.push_str(&format!("  {name:<32} {what}\n"));
        }
    }
    s.push('\n');
    s.push_str(&leasehold_telemetry::env_help());
    s
}

fn fail_config(msg: impl std::fmt::Display) -> ! {
    eprintln!("error: {msg}");
    std::process::exit(CONFIG_ERROR);
}

#[tokio::main]
async fn main() {
    let matches = Options::command().after_help(env_help()).get_matches();
    let opts = Options::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let telemetry = trace::init("leasehold-worker");
    if let Err(e) = opts.validate() {
        fail_config(e);
    }
    let research = ResearchConfig::from_env().unwrap_or_else(|e| fail_config(e.message));
    if research.crash_at.is_some() && !opts.dev_kinds {
        fail_config(
            "LH_RESEARCH_CRASH_AT aborts the worker at a checkpoint; it is for tests and needs --dev-kinds (LH_DEV_KINDS=1)",
        );
    }
    tracing::info!(
        model_base_url = %leasehold_telemetry::redact_url(&research.model.base_url),
        model = %research.model.model,
        api_key = if research.model.api_key.is_some() { "set" } else { "unset" },
        search_url = %leasehold_telemetry::redact_url(&research.toolbox.search.url),
        publish_url = %leasehold_telemetry::redact_url(&research.toolbox.publish.url),
        fetch_allow = %research.toolbox.fetch.allow,
        expert_concurrency = research.expert_concurrency,
        "workload configuration"
    );
    if opts.kinds.iter().any(|k| k == "research") {
        // A model endpoint that does not answer is worth saying at start,
        // not only in each job's error; the worker serves anyway (the
        // endpoint may come up later).
        if let Ok(client) = leasehold_model::ModelClient::new(research.model.clone()) {
            tokio::spawn(async move {
                if let Err(why) = client.reachable(std::time::Duration::from_secs(5)).await {
                    tracing::warn!("model endpoint check at start: {why} (research jobs will fail with this cause until it answers)");
                }
            });
        }
    }
    let fail = |what: String, telemetry: trace::Guard| -> ! {
        eprintln!("error: {}", redact_text(&what));
        telemetry.shutdown();
        std::process::exit(1);
    };
    let worker = Worker::new(opts.clone())
        .with_handler("research", Arc::new(ResearchHandler::with_config(research)));
    match leasehold_worker::process::run(worker, opts.http_listen).await {
        Ok(()) => telemetry.shutdown(),
        Err(e) => fail(format!("{e:#}"), telemetry),
    }
}
