//! `sdk-agent-worker`: a worker built with the `leasehold` crate, as a
//! user builds one, serving the test kind `agent-test`: one `ctx.agent`
//! call with the user's own `search` and `fetch` tools against the
//! simulator (`SIM_URL`) and its model (`SIM_URL/v1`). For the tests that
//! kill it in the middle of the conversation. And `nap`: a step, a durable
//! sleep of `input.ms`, a step (tests/it/timers.rs), for the tests that
//! kill it, or the whole fleet, while the job sleeps; `hark`, waits for
//! signals (tests/it/signals.rs).

use std::time::Duration;

use leasehold::{
    async_trait, Agent, BoxFuture, Ctx, Error, ExecCtx, Kind, ModelConfig, Tool, ToolError,
    ToolKind, ToolSpec,
};
use serde_json::{json, Value};

struct Web {
    spec: ToolSpec,
    sim: String,
    http: reqwest::Client,
}

impl Web {
    fn new(name: &str, sim: &str) -> Web {
        Web {
            spec: ToolSpec {
                name: name.into(),
                description: format!("{name} the web"),
                kind: ToolKind::Read,
                schema: json!({"type": "object"}),
                timeout: Duration::from_secs(10),
            },
            sim: sim.into(),
            http: reqwest::Client::new(),
        }
    }
}

impl Tool for Web {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }
    fn execute<'a>(
        &'a self,
        args: &'a Value,
        _: &'a ExecCtx,
    ) -> BoxFuture<'a, Result<Value, ToolError>> {
        Box::pin(async move {
            let req = if self.spec.name == "search" {
                let q = args["q"].as_str().unwrap_or("leases");
                self.http
                    .get(format!("{}/search", self.sim))
                    .query(&[("q", q), ("format", "json")])
            } else {
                self.http.get(args["url"].as_str().unwrap_or_default())
            };
            let r = req
                .send()
                .await
                .map_err(|e| ToolError::Transport(e.to_string()))?;
            let text = r
                .text()
                .await
                .map_err(|e| ToolError::Transport(e.to_string()))?;
            Ok(serde_json::from_str(&text).unwrap_or(Value::String(text)))
        })
    }
}

struct AgentTest;

#[async_trait]
impl Kind for AgentTest {
    async fn run(&self, ctx: &Ctx) -> Result<Value, Error> {
        let out = ctx
            .agent(
                "section",
                &Agent::new(
                    "sim",
                    "You research and cite what you read.",
                    "Write one section about leases.",
                )
                .tools(["search", "fetch"]),
            )
            .await?;
        Ok(json!({"text": out.text, "model_calls": out.model_calls}))
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // The agent's model and tools (unused by `nap`).
    let sim = std::env::var("SIM_URL").unwrap_or_else(|_| "http://127.0.0.1:9".into());
    let model = ModelConfig {
        base_url: format!("{sim}/v1"),
        ..Default::default()
    };
    leasehold::Worker::from_env()
        .kind("agent-test", AgentTest)
        .kind("nap", leasehold_tests::Nap)
        .kind("hark", leasehold_tests::Hark)
        .model("sim", model)
        .tool(Web::new("search", &sim))
        .tool(Web::new("fetch", &sim))
        .run()
        .await
}
