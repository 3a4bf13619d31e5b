//! `search`: web search through the SearxNG JSON API
//! (`GET $LH_SEARCH_URL/search?q=..&format=json`), so a self-hosted SearxNG
//! or the simulator answer the same way.

use std::time::Duration;

use futures::future::BoxFuture;
use serde_json::{json, Value};

use super::check_status;
use crate::error::{from_reqwest, ToolError};
use crate::tool::{ExecCtx, Tool, ToolKind, ToolSpec};

/// Configuration of `search`.
#[derive(Debug, Clone)]
pub struct SearchConfig {
    /// SearxNG base URL (`LH_SEARCH_URL`); `/search` is appended.
    pub url: String,
    /// Time limit of one request (default 10 s).
    pub timeout: Duration,
    /// Results returned when the call does not say (default 5).
    pub default_results: usize,
}

impl Default for SearchConfig {
    fn default() -> Self {
        SearchConfig {
            url: crate::toolbox::DEFAULT_BASE_URL.into(),
            timeout: Duration::from_secs(10),
            default_results: 5,
        }
    }
}

/// The `search` tool.
pub struct SearchTool {
    config: SearchConfig,
    spec: ToolSpec,
    client: reqwest::Client,
}

impl SearchTool {
    pub fn new(config: SearchConfig) -> Result<Self, ToolError> {
        let client = reqwest::Client::builder()
            .timeout(config.timeout)
            .user_agent(concat!("leasehold-search/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| ToolError::Config(format!("search client: {e}")))?;
        let spec = ToolSpec {
            name: "search".into(),
            description: "Search the web. Returns results with title, url and a content snippet."
                .into(),
            kind: ToolKind::Read,
            schema: json!({
                "type": "object",
                "properties": {
                    "q": {"type": "string", "minLength": 1, "maxLength": 400, "description": "the search query"},
                    "max_results": {"type": "integer", "minimum": 1, "maximum": 20}
                },
                "required": ["q"],
                "additionalProperties": false
            }),
            timeout: config.timeout,
        };
        Ok(SearchTool {
            config,
            spec,
            client,
        })
    }

    async fn run(&self, args: &Value) -> Result<Value, ToolError> {
        let q = args["q"].as_str().unwrap_or_default();
        let n = args["max_results"]
            .as_u64()
            .map(|n| n as usize)
            .unwrap_or(self.config.default_results);
        let resp = self
            .client
            .get(format!("{}/search", self.config.url))
            .query(&[("q", q), ("format", "json")])
            .send()
            .await
            .map_err(|e| from_reqwest(e, self.config.timeout))?;
        let resp = check_status(resp).await?;
        let body: Value = resp
            .json()
            .await
            .map_err(|e| ToolError::BadResponse(format!("search answer is not JSON: {e}")))?;
        let Some(items) = body.get("results").and_then(Value::as_array) else {
            return Err(ToolError::BadResponse(
                "search answer has no `results` array".into(),
            ));
        };
        let results: Vec<Value> = items
            .iter()
            .filter(|r| r.get("url").and_then(Value::as_str).is_some())
            .take(n)
            .map(|r| {
                json!({
                    "title": r.get("title").and_then(Value::as_str).unwrap_or_default(),
                    "url": r.get("url").and_then(Value::as_str).unwrap_or_default(),
                    "content": r.get("content").and_then(Value::as_str).unwrap_or_default(),
                })
            })
            .collect();
        Ok(json!({ "query": q, "results": results }))
    }
}

impl Tool for SearchTool {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    fn endpoint(&self) -> String {
        format!("{}/search", self.config.url)
    }

    fn execute<'a>(
        &'a self,
        args: &'a Value,
        _ctx: &'a ExecCtx,
    ) -> BoxFuture<'a, Result<Value, ToolError>> {
        Box::pin(self.run(args))
    }
}
