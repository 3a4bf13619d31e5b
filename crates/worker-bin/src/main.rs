//! `leasehold-worker`: the stock worker binary. See `leasehold-worker --help`.
//!
//! It is built like any user's worker, on the public `leasehold` SDK: the
//! `research` kind (and its experts' `research-expert`) registered on a [`leasehold::Worker`] beside the
//! engine's built-in kinds (`deliver` and, with `--dev-kinds`, the test
//! kinds).
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

use leasehold::runtime::{ModelClient, MODEL_ENV_VARS, TOOL_ENV_VARS};
use leasehold::telemetry::{self, redact_text, redact_url};
use leasehold_research::{Research, ResearchConfig, ResearchExpert, EXPERT_KIND};

/// Exit code of a configuration error found at start (as clap's usage errors).
const CONFIG_ERROR: i32 = 2;

/// The `--help` section listing the variables that are not flags.
fn env_help() -> String {
    let mut s = String::from(
        "Workload variables (not flags; read and validated at start, a bad value stops the worker).\n\
         Durations need a unit: 500ms, 3s, 2m.\n",
    );
    let sections: [(&str, &[(&str, &str)]); 3] = [
        ("Model (research)", MODEL_ENV_VARS),
        ("Tools (research, deliver)", TOOL_ENV_VARS),
        ("Research", leasehold_research::ENV_VARS),
    ];
    for (title, vars) in sections {
        s.push_str(&format!("\n{title}:\n"));
        for (name, what) in vars {
            s.push_str(&format!("  {name:<32} {what}\n"));
        }
    }
    s.push('\n');
    s.push_str(&telemetry::env_help());
    s
}

fn fail_config(msg: impl std::fmt::Display) -> ! {
    eprintln!("error: {msg}");
    std::process::exit(CONFIG_ERROR);
}

#[tokio::main]
async fn main() {
    // Flags and LH_* variables, validated (exit 2 on a bad one).
    let worker = leasehold::Worker::from_env_with_help(&env_help());
    let opts = worker.options().clone();
    let guard = telemetry::init("leasehold-worker");
    let research = ResearchConfig::from_env().unwrap_or_else(|e| fail_config(e.to_string()));
    if research.crash_at.is_some() && !opts.dev_kinds {
        fail_config(
            "LH_RESEARCH_CRASH_AT aborts the worker at a checkpoint; it is for tests and needs --dev-kinds (LH_DEV_KINDS=1)",
        );
    }
    tracing::info!(
        model_base_url = %redact_url(&research.model.base_url),
        model = %research.model.model,
        api_key = if research.model.api_key.is_some() { "set" } else { "unset" },
        search_url = %redact_url(&research.toolbox.search.url),
        publish_url = %redact_url(&research.toolbox.publish.url),
        fetch_allow = %research.toolbox.fetch.allow,
        expert_concurrency = research.expert_concurrency,
        "workload configuration"
    );
    if opts.kinds.iter().any(|k| k == "research") {
        // A model endpoint that does not answer is worth saying at start,
        // not only in each job's error; the worker serves anyway (the
        // endpoint may come up later).
        // It shares the research jobs' provider records: an answer here
        // tells their first failed connection apart from a wrong URL.
        if let Ok(client) = ModelClient::new(research.model.clone()) {
            let client = client.sharing(research.providers.clone());
            tokio::spawn(async move {
                if let Err(why) = client.reachable(std::time::Duration::from_secs(5)).await {
                    tracing::warn!("model endpoint check at start: {why} (research jobs will fail with this cause until it answers)");
                }
            });
        }
    }
    let worker = worker.kind("research", Research::with_config(research.clone()));
    // Research's experts as child jobs (`"expert_jobs": true`) run where
    // `--kinds` names `research-expert` (and `leasehold setup` set it up):
    // a fleet that never asks for them needs no lane for them.
    let worker = match opts.kinds.iter().any(|k| k == EXPERT_KIND) {
        true => worker.kind(EXPERT_KIND, ResearchExpert::with_config(research)),
        false => worker,
    };
    let r = worker.serve().await;
    match r {
        Ok(()) => guard.shutdown(),
        Err(e) => {
            eprintln!("error: {}", redact_text(&format!("{e:#}")));
            guard.shutdown();
            std::process::exit(1);
        }
    }
}
