//! The built-in kinds, written against the SDK like any user's kind:
//! `echo`, `sleep`, `fail`, `crash` and `fanout` for tests, the demo and
//! benchmarks,
//! and `deliver`, the demo of the effects ledger. Every worker built with
//! [`crate::Worker`] has them; it serves the ones its `--kinds` name.

use std::sync::Arc;
use std::time::Duration;

use leasehold_tools::{CallCtx, CollectEvents, Disposition, NoEvents, Toolbox, ToolboxConfig};
use serde_json::{json, Value};
use tokio::sync::OnceCell;

use crate::{async_trait, Ctx, Error, Kind};

/// The built-in kinds by name.
pub(crate) fn kinds() -> Vec<(String, Arc<dyn Kind>)> {
    vec![
        ("echo".into(), Arc::new(Echo) as Arc<dyn Kind>),
        ("sleep".into(), Arc::new(Sleep)),
        ("fail".into(), Arc::new(Fail)),
        ("crash".into(), Arc::new(Crash)),
        ("fanout".into(), Arc::new(Fanout)),
        ("deliver".into(), Arc::new(Deliver::default())),
    ]
}

/// Sleeps `ms` milliseconds, or until the attempt must stop.
async fn nap(ctx: &Ctx, ms: u64) -> Result<(), Error> {
    tokio::select! {
        _ = tokio::time::sleep(Duration::from_millis(ms)) => Ok(()),
        _ = ctx.cancelled().cancelled() => Err(Error::Cancelled),
    }
}

fn number(ctx: &Ctx, field: &str) -> Option<u64> {
    ctx.input_json().get(field).and_then(Value::as_u64)
}

/// `echo`: the result is the input.
struct Echo;

#[async_trait]
impl Kind for Echo {
    async fn run(&self, ctx: &Ctx) -> Result<Value, Error> {
        Ok(ctx.input_json().clone())
    }
}

/// `sleep`: input `{"ms": N}`; sleeps holding its slot (the runner
/// heartbeats meanwhile). With `"durable": true` it is a durable timer
/// (`ctx.sleep`): the job waits `waiting`, holding no slot, and completes
/// on whichever worker takes it at its time. With `"signal": NAME` it then
/// waits for the signal `NAME` (`ctx.wait_for`, no slot held) and its
/// output's `signal` is the signal's data.
struct Sleep;

#[async_trait]
impl Kind for Sleep {
    async fn run(&self, ctx: &Ctx) -> Result<Value, Error> {
        let ms = number(ctx, "ms").unwrap_or(0);
        let durable = ctx.input_json().get("durable").and_then(Value::as_bool) == Some(true);
        if durable {
            ctx.sleep(Duration::from_millis(ms)).await?;
        } else {
            nap(ctx, ms).await?;
        }
        let mut out = json!({"slept_ms": ms});
        if durable {
            out["durable"] = json!(true);
        }
        if let Some(name) = ctx.input_json().get("signal").and_then(Value::as_str) {
            let name = name.to_string();
            let got = ctx.wait_for(&name, None).await?;
            out["signal"] = got.map(|s| s.data).unwrap_or(Value::Null);
        }
        Ok(out)
    }
}

/// `fail`: input `{"class": "retryable"|"terminal", "times": N, "ms": M}`:
/// runs for M milliseconds (default 0), then fails while fewer than N
/// attempts have failed, then succeeds. `{"class": "park"}` parks the job
/// for a person instead, and completes once resumed (when the job already
/// has a `parked` event).
struct Fail;

#[async_trait]
impl Kind for Fail {
    async fn run(&self, ctx: &Ctx) -> Result<Value, Error> {
        let ms = number(ctx, "ms").unwrap_or(0);
        if ms > 0 {
            nap(ctx, ms).await?;
        }
        let class = ctx.input_json().get("class").and_then(Value::as_str);
        if class == Some("park") {
            let parked = ctx
                .events()
                .events
                .last_of_type(ctx.id(), "parked")
                .await
                .map_err(|e| Error::retryable(format!("reading the job's events: {e}")))?;
            return match parked {
                None => Err(Error::park("injected", "a park for review (test kind)")),
                Some(_) => Ok(json!({"resumed": true})),
            };
        }
        let times = number(ctx, "times").unwrap_or(u64::MAX);
        let failed = u64::from(ctx.failed_attempts());
        if failed < times {
            let m = format!("injected failure {} of {times}", failed + 1);
            return Err(match class {
                Some("terminal") => Error::terminal(m),
                _ => Error::retryable(m),
            });
        }
        Ok(json!({"failed_attempts": failed}))
    }
}

/// `fanout`: spawns child jobs of `kind` (default `echo`), one per
/// `inputs` (default: `n` inputs `{"i": i}`, 3 by default), detached when
/// `detach`, then joins them; its output lists the children and their
/// outcomes. `nest: k` > 0 spawns one `fanout` child with `nest: k - 1`
/// instead (a chain k deep). `pause_ms` holds the slot that long in the
/// first attempt, between the spawn and the join (for fault tests).
struct Fanout;

#[async_trait]
impl Kind for Fanout {
    async fn run(&self, ctx: &Ctx) -> Result<Value, Error> {
        let input = ctx.input_json().clone();
        let nest = input["nest"].as_u64().unwrap_or(0);
        let (kind, inputs) = if nest > 0 {
            ("fanout".to_string(), vec![json!({"nest": nest - 1})])
        } else {
            let kind = input["kind"].as_str().unwrap_or("echo").to_string();
            let inputs = match input["inputs"].as_array() {
                Some(l) => l.clone(),
                None => (0..input["n"].as_u64().unwrap_or(3))
                    .map(|i| json!({"i": i}))
                    .collect(),
            };
            (kind, inputs)
        };
        let opts = crate::SpawnOptions {
            detach: input["detach"].as_bool() == Some(true),
        };
        let children = ctx.spawn_many_with(&kind, inputs, opts).await?;
        if let Some(ms) = input["pause_ms"].as_u64() {
            // A step in every attempt (the journal stays one sequence),
            // which waits only in the first.
            let first = ctx.epoch() == 1;
            ctx.step("pause", || async move {
                if first {
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                }
                Ok(())
            })
            .await?;
        }
        let outcomes = ctx.join(&children).await?;
        let completed = outcomes.iter().filter(|o| o.completed()).count();
        Ok(json!({
            "children": children.iter().map(|c| c.id.clone()).collect::<Vec<_>>(),
            "completed": completed,
            "outcomes": outcomes,
        }))
    }
}

/// `crash`: aborts the worker process (for poison-job and crash tests).
struct Crash;

#[async_trait]
impl Kind for Crash {
    async fn run(&self, ctx: &Ctx) -> Result<Value, Error> {
        tracing::warn!(job = %ctx.id(), "crash job: aborting this worker process");
        std::process::abort();
    }
}

/// `deliver`: input `{"title": T, "document": D}`; it calls the built-in
/// `publish` tool once under the step id `deliver#0`, so every attempt and
/// every reclaim of the job uses the same idempotency key: a delivery whose
/// outcome is unknown is reconciled at the destination before anything
/// runs again, and an unknowable outcome parks the job instead of
/// guessing. The effect runs only after a fenced write proved this attempt
/// still owns the job ([`Ctx::owner_guard`]). Its toolbox is built on first
/// use.
#[derive(Default)]
struct Deliver {
    toolbox: OnceCell<Toolbox>,
}

impl Deliver {
    async fn toolbox(&self, ctx: &Ctx) -> Result<&Toolbox, Error> {
        self.toolbox
            .get_or_try_init(|| async {
                let cfg = ToolboxConfig::from_env()
                    .map_err(|e| Error::terminal(format!("tool configuration: {e}")))?;
                let ledger = ctx.effects_ledger().await?;
                Toolbox::builtin(&cfg, Some(ledger), Arc::new(NoEvents))
                    .map_err(|e| Error::terminal(format!("toolbox: {e}")))
            })
            .await
    }
}

#[async_trait]
impl Kind for Deliver {
    async fn run(&self, ctx: &Ctx) -> Result<Value, Error> {
        let tb = self.toolbox(ctx).await?;
        let input = ctx.input_json();
        let text = |f: &str, or: &'static str| input.get(f).and_then(Value::as_str).unwrap_or(or);
        let args = json!({"title": text("title", "untitled"), "document": text("document", "")});
        let call = CallCtx::new(ctx.id(), "deliver#0", ctx.epoch())
            .of_incarnation(&ctx.record().created_at)
            .guarded(ctx.owner_guard());
        let events = CollectEvents::new();
        let res = tokio::select! {
            r = tb.call_with(&call, "publish", &args, &events) => r,
            _ = ctx.cancelled().cancelled() => return Err(Error::Cancelled),
        };
        for ev in events.events() {
            let _ = ctx
                .job()
                .emit("tool", serde_json::to_value(&ev).unwrap_or_default())
                .await;
        }
        match res {
            Ok(out) => Ok(json!({"key": out.key, "outcome": out.outcome, "value": out.value})),
            Err(e) => Err(match e.disposition() {
                Disposition::Park => Error::park(e.class(), e.to_string()),
                // Not the owner any more: nothing ran, nothing to write.
                Disposition::Stop => Error::Cancelled,
                Disposition::Retry => Error::retryable(e.to_string()),
                _ => Error::terminal(e.to_string()),
            }),
        }
    }
}
