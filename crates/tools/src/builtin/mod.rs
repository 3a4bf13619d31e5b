//! The built-in tools of the research workload: `search`, `fetch`, `publish`.

pub mod fetch;
pub mod publish;
pub mod search;

use crate::error::ToolError;

/// A short excerpt of an error body for messages (bodies can be large).
pub(crate) fn excerpt(s: &str) -> String {
    let s = s.trim();
    match s.char_indices().nth(300) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}

/// Turns a non-success status into the matching error.
pub(crate) async fn check_status(resp: reqwest::Response) -> Result<reqwest::Response, ToolError> {
    let status = resp.status();
    if status.is_success() {
        return Ok(resp);
    }
    let body = resp.text().await.unwrap_or_default();
    Err(ToolError::Upstream {
        status: status.as_u16(),
        message: excerpt(&body),
    })
}
