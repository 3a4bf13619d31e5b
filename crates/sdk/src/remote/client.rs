//! The HTTP side of the protocol: requests signed ([`signature`], over
//! [`hmac_sha256`]) and bounded, and why a call gave no usable answer.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use leasehold_tools::request_may_have_been_sent;
use serde_json::Value;
use sha2::{Digest, Sha256};

use super::{RemoteConfig, PROTOCOL, SIGNATURE_HEADER};
use crate::ToolError;

/// Connection refusals are retried in the call at 200 ms, 400 ms, ... up
/// to this delay (3 s in all) before the attempt ends.
const CONNECT_RETRY_CAP: Duration = Duration::from_millis(1600);

/// HMAC-SHA256 (RFC 2104) of `msg` under `key`.
pub fn hmac_sha256(key: &[u8], msg: &[u8]) -> [u8; 32] {
    let mut k = [0u8; 64];
    if key.len() > 64 {
        k[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        k[..key.len()].copy_from_slice(key);
    }
    let (mut ipad, mut opad) = ([0x36u8; 64], [0x5cu8; 64]);
    for i in 0..64 {
        ipad[i] ^= k[i];
        opad[i] ^= k[i];
    }
    let inner = Sha256::new()
        .chain_update(ipad)
        .chain_update(msg)
        .finalize();
    Sha256::new()
        .chain_update(opad)
        .chain_update(inner)
        .finalize()
        .into()
}

/// The signature header's value for one request at unix time `t`:
/// `t=<t>,n=<nonce>,v2=<hex>`, the HMAC-SHA256 of
/// `<t>.<nonce>.<METHOD>.<path>.<body>`. It binds the endpoint (a signed
/// call to one tool is not a call to another, nor to `find_existing`) and,
/// by its nonce (fresh for every request), one request: a service serves a
/// nonce once within the time tolerance.
///
/// ```
/// let h = leasehold::signature("s3cret", 1_700_000_000, "n1", "POST", "/invoke", b"{}");
/// assert!(h.starts_with("t=1700000000,n=n1,v2="));
/// ```
pub fn signature(
    secret: &str,
    t: u64,
    nonce: &str,
    method: &str,
    path: &str,
    body: &[u8],
) -> String {
    let mut msg = format!("{t}.{nonce}.{method}.{path}.").into_bytes();
    msg.extend_from_slice(body);
    format!(
        "t={t},n={nonce},v2={}",
        hex::encode(hmac_sha256(secret.as_bytes(), &msg))
    )
}

/// Why a call to the service gave no usable answer.
#[derive(Debug)]
pub(super) enum CallError {
    /// The HTTP exchange failed (not reached, reset, timed out, a broken
    /// answer): worth another attempt. The client's error is kept, because
    /// its kind, not its text, says whether the request may have reached
    /// the service ([`leasehold_tools::request_may_have_been_sent`]).
    Http {
        error: reqwest::Error,
        timeout: Duration,
    },
    /// The service answered an HTTP error status without an error object:
    /// the request reached it.
    Status(u16),
    /// An answer that breaks the protocol (not JSON, wrong schema, too large).
    Protocol(String),
    /// The service's own error object (`{"error": {"code", "message"}}`).
    Service { code: String, message: String },
}

/// The HTTP side of the protocol: signed, bounded calls.
pub(super) struct Client {
    pub(super) cfg: RemoteConfig,
    pub(super) http: reqwest::Client,
}

impl Client {
    pub(super) async fn post(
        &self,
        path: &str,
        body: &Value,
        timeout: Duration,
    ) -> Result<Value, CallError> {
        let body = serde_json::to_vec(body).map_err(|e| CallError::Protocol(e.to_string()))?;
        if body.len() > self.cfg.max_body {
            return Err(CallError::Protocol(format!(
                "request_too_large: the request is {} bytes, the limit {} (LH_REMOTE_MAX_BODY)",
                body.len(),
                self.cfg.max_body
            )));
        }
        let url = format!("{}{path}", self.cfg.url);
        let mut req = self
            .http
            .post(&url)
            .timeout(timeout)
            .header("content-type", "application/json")
            .header("x-leasehold-protocol", PROTOCOL.to_string());
        if let Some(t) = &self.cfg.token {
            req = req.bearer_auth(t);
        }
        if let Some(s) = &self.cfg.hmac_secret {
            let t = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0);
            // The path as the service reads it (the base URL's own path
            // included), so the signature binds the endpoint.
            let signed_path = reqwest::Url::parse(&url)
                .map(|u| u.path().to_string())
                .unwrap_or_else(|_| path.to_string());
            let nonce = uuid::Uuid::new_v4().simple().to_string();
            req = req.header(
                SIGNATURE_HEADER,
                signature(s, t, &nonce, "POST", &signed_path, &body),
            );
        }
        // A request that was certainly never sent (a connection refused)
        // never reached the service: safe to try again at once (a service
        // restarting), a few times, before the attempt ends. Anything after
        // a byte may have left goes back to the caller, which reconciles.
        let mut backoff = Duration::from_millis(200);
        let mut resp = loop {
            let Some(r) = req.try_clone() else {
                break req.body(body).send().await;
            };
            match r.body(body.clone()).send().await {
                Err(e) if !request_may_have_been_sent(&e) && backoff <= CONNECT_RETRY_CAP => {
                    tokio::time::sleep(backoff).await;
                    backoff *= 2;
                }
                r => break r,
            }
        }
        .map_err(|error| CallError::Http { error, timeout })?;
        let status = resp.status().as_u16();
        let mut buf: Vec<u8> = Vec::new();
        loop {
            match resp.chunk().await {
                Ok(Some(c)) => {
                    buf.extend_from_slice(&c);
                    if buf.len() > self.cfg.max_body {
                        return Err(CallError::Protocol(format!(
                            "answer_too_large: the answer is over the limit of {} bytes (LH_REMOTE_MAX_BODY)",
                            self.cfg.max_body
                        )));
                    }
                }
                Ok(None) => break,
                Err(error) => return Err(CallError::Http { error, timeout }),
            }
        }
        let v: Value = serde_json::from_slice(&buf).map_err(|e| {
            let head = String::from_utf8_lossy(&buf[..buf.len().min(120)]).to_string();
            CallError::Protocol(format!(
                "not_json: the answer (HTTP {status}) is not JSON ({e}): {head:?}"
            ))
        })?;
        if let Some(err) = v.get("error").filter(|e| e.is_object()) {
            return Err(CallError::Service {
                code: err["code"].as_str().unwrap_or("unknown").to_string(),
                message: err["message"].as_str().unwrap_or("").to_string(),
            });
        }
        if !(200..300).contains(&status) {
            return Err(CallError::Status(status));
        }
        match v.get("protocol").and_then(Value::as_u64) {
            Some(PROTOCOL) => Ok(v),
            Some(p) => Err(CallError::Protocol(format!(
                "unsupported_protocol: the service answered with protocol {p}, this worker speaks {PROTOCOL}"
            ))),
            None => Err(CallError::Protocol(
                "bad_answer: the answer has no `protocol` field".into(),
            )),
        }
    }
}

pub(super) fn tool_error(e: CallError) -> ToolError {
    match e {
        // The one rule for "may the request have been sent" decides.
        CallError::Http { error, timeout } => ToolError::from_reqwest(error, timeout),
        CallError::Status(status) => ToolError::Transport(format!(
            "the service answered HTTP {status} without an error object"
        )),
        CallError::Protocol(m) => ToolError::BadResponse(m),
        CallError::Service { code, message } => ToolError::Upstream {
            status: match code.as_str() {
                "terminal" => 400,
                "conflict" => 409,
                _ => 503,
            },
            message: format!("{code}: {message}"),
        },
    }
}
