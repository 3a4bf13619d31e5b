//! `leasehold tool`: run or list tools through the same layer and effects
//! ledger the workers use.
//!
//! - `leasehold tool call NAME --args JSON [--job ID --step ID] [--epoch N]`
//!   runs one call and prints the result JSON on stdout. With `--job` and
//!   `--step` the idempotency key is derived exactly as inside that job, so
//!   repeating the command replays the stored result of a write instead of
//!   repeating its effect. A write's key is the job, the step and the tool,
//!   not the arguments: the same `--job`/`--step` with other arguments is
//!   refused (`key_reuse`, exit 3) and nothing is sent. Without them every
//!   call is its own one-off step. `--args @FILE` reads the arguments from a
//!   file, `--args -` from stdin.
//! - `leasehold tool list [--json]` shows the configured tools, their kind and
//!   endpoint.
//!
//! Tools are configured by `LH_SEARCH_URL`, `LH_FETCH_ALLOW`,
//! `LH_FETCH_MAX_BYTES`, `LH_FETCH_TIMEOUT`, `LH_PUBLISH_URL`,
//! `LH_PUBLISH_DEDUPES` and `LH_TOOL_FAULTS` (see `leasehold_tools`).
//!
//! Exit codes of `call`: 0 success; 1 the call failed (the error class and
//! message on stderr); 2 bad usage or invalid arguments; 3 the outcome of an
//! earlier attempt is uncertain, or the step already made its effect with
//! other arguments (a job would be parked for review).

use std::io::Read;
use std::sync::Arc;

use anyhow::Context;
use leasehold_store::NatsArgs;
use leasehold_tools::{
    CallCtx, Disposition, EffectsLedger, NoEvents, ToolError, ToolEvent, ToolEvents, ToolKind,
    Toolbox, ToolboxConfig,
};

#[derive(clap::Args, Debug)]
#[command(
    after_help = "Tools read LH_SEARCH_URL, LH_FETCH_ALLOW, LH_FETCH_MAX_BYTES, LH_FETCH_TIMEOUT, \
LH_PUBLISH_URL, LH_PUBLISH_DEDUPES and LH_TOOL_FAULTS; the default endpoints are on http://127.0.0.1:8089 (leasehold-sim)."
)]
pub struct Args {
    #[command(subcommand)]
    pub cmd: ToolCmd,
}

#[derive(clap::Subcommand, Debug)]
pub enum ToolCmd {
    /// Run one tool call (writes go through the effects ledger) and print its result as JSON.
    Call(CallArgs),
    /// Show the configured tools, their kind and endpoint.
    List(ListArgs),
}

#[derive(clap::Args, Debug)]
pub struct CallArgs {
    /// Tool name (see `leasehold tool list`).
    pub name: String,
    /// Arguments as a JSON object; `@FILE` reads a file, `-` reads stdin.
    #[arg(long, default_value = "{}")]
    pub args: String,
    /// Job id the call belongs to; with --step, derives the key exactly as inside that job.
    #[arg(long, requires = "step")]
    pub job: Option<String>,
    /// Step id (section id plus call ordinal, e.g. `section-2#1`); needs --job.
    #[arg(long, requires = "job")]
    pub step: Option<String>,
    /// Epoch recorded in the ledger with the call. A key a worker left in flight is only
    /// reconciled by an epoch at least as new as the worker's (use the job's current epoch).
    #[arg(long, default_value_t = 0)]
    pub epoch: u64,
    /// Print the whole outcome (key, how the result was obtained, attempts)
    /// as one JSON document instead of the result alone.
    #[arg(long, visible_alias = "json")]
    pub full: bool,
    /// Print the tool events on stderr.
    #[arg(long, short)]
    pub verbose: bool,
}

#[derive(clap::Args, Debug)]
pub struct ListArgs {
    /// Print the tool declarations (with argument schemas) as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Prints tool events on stderr, one JSON line each.
struct StderrEvents;

impl ToolEvents for StderrEvents {
    fn emit(&self, ev: ToolEvent) {
        eprintln!("{}", serde_json::to_string(&ev).unwrap_or_default());
    }
}

pub async fn run(args: Args, nats: &NatsArgs) -> anyhow::Result<i32> {
    match args.cmd {
        ToolCmd::Call(a) => call(a, nats).await,
        ToolCmd::List(a) => list(a),
    }
}

fn read_args(raw: &str) -> anyhow::Result<serde_json::Value> {
    let text = if raw == "-" {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .context("reading arguments from stdin")?;
        s
    } else if let Some(path) = raw.strip_prefix('@') {
        std::fs::read_to_string(path).with_context(|| format!("reading arguments from {path}"))?
    } else {
        raw.to_string()
    };
    serde_json::from_str(&text).context("--args is not valid JSON")
}

async fn call(a: CallArgs, nats: &NatsArgs) -> anyhow::Result<i32> {
    let args = match read_args(&a.args) {
        Ok(v) => v,
        Err(e) => {
            eprintln!("error: {e:#}");
            return Ok(2);
        }
    };
    let config = ToolboxConfig::from_env()?;
    let events: Arc<dyn ToolEvents> = if a.verbose {
        Arc::new(StderrEvents)
    } else {
        Arc::new(NoEvents)
    };
    // Only writes need the ledger; reads run without NATS. Validation comes
    // first so a bad call fails the same way with or without NATS.
    let probe = Toolbox::builtin(&config, None, events.clone())?;
    let kind = match probe.validate(&a.name, &args) {
        Ok(spec) => spec.kind,
        Err(e) => {
            if matches!(e, ToolError::UnknownTool(_)) {
                let names: Vec<&str> = probe.specs().iter().map(|s| s.name.as_str()).collect();
                eprintln!("error [{}]: {e} (tools: {})", e.class(), names.join(", "));
            } else {
                eprintln!("error [{}]: {e}", e.class());
            }
            return Ok(2);
        }
    };
    let toolbox = if kind == ToolKind::Write {
        let conn = nats.connect("leasehold-cli").await?;
        let ledger = EffectsLedger::open(&conn.js, &conn.layout.effects_bucket()).await?;
        Toolbox::builtin(&config, Some(ledger), events)?
    } else {
        probe
    };
    let (job, step) = match (a.job, a.step) {
        (Some(j), Some(s)) => (j, s),
        // A one-off call: a fresh job id makes a fresh key.
        _ => (
            format!("cli-{}", uuid::Uuid::new_v4()),
            "call#1".to_string(),
        ),
    };
    let ctx = CallCtx::new(job, step, a.epoch);
    match toolbox.call(&ctx, &a.name, &args).await {
        Ok(out) => {
            let shown = if a.full {
                serde_json::to_value(&out)?
            } else {
                out.value.clone()
            };
            print_out(&serde_json::to_string_pretty(&shown)?);
            eprintln!(
                "{} {:?} (key {}, attempts {})",
                out.tool, out.outcome, out.key, out.attempts
            );
            Ok(0)
        }
        Err(e) => {
            eprintln!("error [{}]: {e}", e.class());
            Ok(match (e.class(), e.disposition()) {
                ("validation", _) => 2,
                (_, Disposition::Park) => 3,
                _ => 1,
            })
        }
    }
}

fn list(a: ListArgs) -> anyhow::Result<i32> {
    let config = ToolboxConfig::from_env()?;
    let tb = Toolbox::builtin(&config, None, Arc::new(NoEvents))?;
    if a.json {
        let specs: Vec<serde_json::Value> = tb
            .specs()
            .into_iter()
            .map(|s| {
                let mut v = serde_json::to_value(s).unwrap_or_default();
                v["endpoint"] = tb
                    .tool(&s.name)
                    .map(|t| t.endpoint())
                    .unwrap_or_default()
                    .into();
                v
            })
            .collect();
        print_out(&serde_json::to_string_pretty(&specs)?);
        return Ok(0);
    }
    let mut table = format!("{:<10} {:<7} {:<9} ENDPOINT", "NAME", "KIND", "TIMEOUT");
    for s in tb.specs() {
        let endpoint = tb.tool(&s.name).map(|t| t.endpoint()).unwrap_or_default();
        table.push_str(&format!(
            "\n{:<10} {:<7} {:<9} {}",
            s.name,
            s.kind.as_str(),
            humantime::format_duration(s.timeout).to_string(),
            endpoint
        ));
    }
    print_out(&table);
    Ok(0)
}

/// Writes data to stdout; a closed pipe (`| head`) is not an error.
fn print_out(s: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{s}").and_then(|_| out.flush());
}
