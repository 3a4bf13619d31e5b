//! `publish`: a side-effecting delivery, a webhook `POST $LH_PUBLISH_URL`
//! with an `Idempotency-Key` header.
//!
//! - `find_existing` asks the destination by key: `GET $LH_PUBLISH_URL/<key>`
//!   (200 → found, 404 → not found, anything else → unknowable).
//! - Business key: job id plus the SHA-256 of the document, so the same
//!   document published again by a later step is delivered once.
//! - A success status with an empty body is a failure ([`ToolError::EmptySuccess`]),
//!   never a result: nothing proves what the destination did.

use std::time::Duration;

use futures::future::BoxFuture;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use super::{check_status, excerpt};
use crate::error::{chain, from_reqwest, ToolError};
use crate::tool::{ExecCtx, Reconcile, Tool, ToolKind, ToolSpec};

/// Configuration of `publish`.
#[derive(Debug, Clone)]
pub struct PublishConfig {
    /// Webhook URL (`LH_PUBLISH_URL`).
    pub url: String,
    /// Time limit of one request (default 10 s).
    pub timeout: Duration,
    /// Whether the destination deduplicates by `Idempotency-Key`
    /// (`LH_PUBLISH_DEDUPES`, default true); when false an unresolved
    /// `in_flight` parks the job instead of running again.
    pub dedupes_by_key: bool,
}

impl Default for PublishConfig {
    fn default() -> Self {
        PublishConfig {
            url: format!("{}/effects", crate::toolbox::DEFAULT_BASE_URL),
            timeout: Duration::from_secs(10),
            dedupes_by_key: true,
        }
    }
}

/// The `publish` tool.
pub struct PublishTool {
    config: PublishConfig,
    spec: ToolSpec,
    client: reqwest::Client,
}

fn document_digest(args: &Value) -> String {
    hex::encode(Sha256::digest(
        args["document"].as_str().unwrap_or_default().as_bytes(),
    ))
}

impl PublishTool {
    pub fn new(config: PublishConfig) -> Result<Self, ToolError> {
        let client = reqwest::Client::builder()
            .timeout(config.timeout)
            // A redirect of a POST could deliver the effect somewhere else.
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("leasehold-publish/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| ToolError::Config(format!("publish client: {e}")))?;
        let spec = ToolSpec {
            name: "publish".into(),
            description: "Publish a finished document (delivered once, even if asked again)."
                .into(),
            kind: ToolKind::Write,
            schema: json!({
                "type": "object",
                "properties": {
                    "title": {"type": "string", "minLength": 1, "maxLength": 300},
                    "document": {"type": "string", "minLength": 1},
                    "format": {"type": "string", "enum": ["markdown", "text"]}
                },
                "required": ["title", "document"],
                "additionalProperties": false
            }),
            timeout: config.timeout,
        };
        Ok(PublishTool {
            config,
            spec,
            client,
        })
    }

    async fn run(&self, args: &Value, ctx: &ExecCtx) -> Result<Value, ToolError> {
        let body = json!({
            "job_id": ctx.job_id,
            "step_id": ctx.step_id,
            "title": args["title"],
            "format": args.get("format").cloned().unwrap_or(json!("markdown")),
            "document": args["document"],
            "document_sha256": document_digest(args),
        });
        let resp = self
            .client
            .post(&self.config.url)
            .header("Idempotency-Key", &ctx.idempotency_key)
            .json(&body)
            .send()
            .await
            .map_err(|e| from_reqwest(e, self.config.timeout))?;
        let resp = check_status(resp).await?;
        let status = resp.status().as_u16();
        let bytes = resp
            .bytes()
            .await
            .map_err(|e| from_reqwest(e, self.config.timeout))?;
        parse_result(status, &bytes)
    }

    async fn lookup(&self, key: &str) -> Reconcile {
        let url = format!("{}/{key}", self.config.url);
        let resp = match self.client.get(&url).send().await {
            Ok(r) => r,
            Err(e) => return Reconcile::Unavailable(format!("asking {url} failed: {}", chain(&e))),
        };
        let status = resp.status();
        if status == reqwest::StatusCode::NOT_FOUND {
            return Reconcile::NotFound;
        }
        if status.is_server_error() || status == reqwest::StatusCode::TOO_MANY_REQUESTS {
            return Reconcile::Unavailable(format!("{url} answered HTTP {status}"));
        }
        if !status.is_success() {
            let body = resp.text().await.unwrap_or_default();
            return Reconcile::Unknowable(format!(
                "{url} answered HTTP {status}: {}",
                excerpt(&body)
            ));
        }
        match resp.bytes().await {
            Ok(b) => match parse_result(status.as_u16(), &b) {
                Ok(v) => Reconcile::Found(v),
                Err(e) => Reconcile::Unknowable(format!("{url}: {e}")),
            },
            Err(e) => Reconcile::Unknowable(format!("{url}: {e}")),
        }
    }
}

/// The destination's answer as a result: JSON as is, other text wrapped,
/// nothing at all a failure.
fn parse_result(status: u16, body: &[u8]) -> Result<Value, ToolError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(ToolError::EmptySuccess);
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Null) => Err(ToolError::EmptySuccess),
        Ok(Value::Object(m)) if m.is_empty() => Err(ToolError::EmptySuccess),
        Ok(v) => Ok(v),
        Err(_) => Ok(json!({ "status": status, "body": String::from_utf8_lossy(body) })),
    }
}

impl Tool for PublishTool {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    fn endpoint(&self) -> String {
        self.config.url.clone()
    }

    fn execute<'a>(
        &'a self,
        args: &'a Value,
        ctx: &'a ExecCtx,
    ) -> BoxFuture<'a, Result<Value, ToolError>> {
        Box::pin(self.run(args, ctx))
    }

    fn business_key(&self, job_id: &str, args: &Value) -> Option<String> {
        Some(format!("{job_id}:{}", document_digest(args)))
    }

    fn find_existing<'a>(&'a self, key: &'a str, _args: &'a Value) -> BoxFuture<'a, Reconcile> {
        Box::pin(self.lookup(key))
    }

    fn dedupes_by_key(&self) -> bool {
        self.config.dedupes_by_key
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_bodies_are_failures_not_results() {
        assert!(matches!(
            parse_result(200, b""),
            Err(ToolError::EmptySuccess)
        ));
        assert!(matches!(
            parse_result(200, b"  \n"),
            Err(ToolError::EmptySuccess)
        ));
        assert!(matches!(
            parse_result(200, b"null"),
            Err(ToolError::EmptySuccess)
        ));
        assert!(matches!(
            parse_result(200, b"{}"),
            Err(ToolError::EmptySuccess)
        ));
        assert_eq!(parse_result(200, br#"{"id":1}"#).unwrap(), json!({"id": 1}));
        assert_eq!(
            parse_result(201, b"ok").unwrap(),
            json!({"status": 201, "body": "ok"})
        );
    }
}
