//! Shared helpers for the integration tests live in `it/`; this library
//! holds the kinds both the tests and the test workers (`bin/`) serve.

use std::time::Duration;

use leasehold::{async_trait, Ctx, Error, Kind};
use serde_json::{json, Value};

/// `nap`: a step, a durable sleep of `input.ms`, a step; its output says
/// when each step ran (ms since the epoch), so a test sees the sleep.
pub struct Nap;

#[async_trait]
impl Kind for Nap {
    async fn run(&self, ctx: &Ctx) -> Result<Value, Error> {
        let ms = ctx.input_json()["ms"].as_u64().unwrap_or(1000);
        let before: u64 = ctx.step("before", || async { Ok(now_ms()) }).await?;
        ctx.sleep(Duration::from_millis(ms)).await?;
        let after: u64 = ctx.step("after", || async { Ok(now_ms()) }).await?;
        Ok(json!({"before_ms": before, "after_ms": after}))
    }
}

/// Now, in milliseconds since the epoch.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as u64
}
