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

/// `hark`: a step (and, with `input.busy_ms`, in its first attempt, a
/// step that sleeps that long holding its slot), then `input.times` (default 1) waits for signal
/// `input.name` (default `go`), each for at most `input.timeout_ms` (none:
/// for as long as it takes); its output lists what each wait took (the
/// signal, or `null` after a timeout) and when the step before ran.
pub struct Hark;

#[async_trait]
impl Kind for Hark {
    async fn run(&self, ctx: &Ctx) -> Result<Value, Error> {
        let input = ctx.input_json();
        let name = input["name"].as_str().unwrap_or("go").to_string();
        let times = input["times"].as_u64().unwrap_or(1);
        let timeout = input["timeout_ms"].as_u64().map(Duration::from_millis);
        let before: u64 = ctx.step("before", || async { Ok(now_ms()) }).await?;
        if let Some(ms) = input["busy_ms"].as_u64().filter(|_| ctx.epoch() == 1) {
            // Holding its slot in its first attempt, for a test to kill
            // its worker meanwhile.
            ctx.step("busy", || async move {
                tokio::time::sleep(Duration::from_millis(ms)).await;
                Ok(())
            })
            .await?;
        }
        let mut got = Vec::new();
        for _ in 0..times {
            got.push(json!(ctx.wait_for(&name, timeout).await?));
        }
        Ok(json!({"before_ms": before, "got": got}))
    }
}

/// Now, in milliseconds since the epoch.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as u64
}
