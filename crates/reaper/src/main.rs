//! `leasehold-reaper`: the reaper binary. See `leasehold-reaper --help`.
//!
//! Logs go to stderr (`LH_LOG_FORMAT=json|text`, `RUST_LOG`); traces to an
//! OTLP/gRPC collector when `OTEL_EXPORTER_OTLP_ENDPOINT` is set; with
//! `--http-listen` (`LH_HTTP_LISTEN`), `/healthz`, `/readyz` and `/metrics`
//! (every series labelled `replica=<reaper id>`).

use clap::{CommandFactory, FromArgMatches};
use leasehold_reaper::ReaperMetrics;
use leasehold_reaper::{Options, Reaper};
use leasehold_telemetry::http::{self, HttpState};
use leasehold_telemetry::{redact_text, stop, trace, Readiness};
use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() {
    // Every variable the reaper reads is a flag's (listed with `[env: ...]`)
    // except the log and trace settings.
    let matches = Options::command()
        .after_help(leasehold_telemetry::env_help())
        .get_matches();
    let mut opts = Options::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    if let Err(e) = opts.validate() {
        eprintln!("error: {e}");
        std::process::exit(2);
    }
    let telemetry = trace::init("leasehold-reaper");
    let fail = |what: String, telemetry: trace::Guard| -> ! {
        eprintln!("error: {}", redact_text(&what));
        telemetry.shutdown();
        std::process::exit(1);
    };
    // The replica label is needed before start(), which would otherwise
    // make up the id itself (same form).
    let reaper_id = opts
        .reaper_id
        .get_or_insert_with(|| format!("r-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]))
        .clone();
    let metrics = ReaperMetrics::new(&reaper_id);
    // Not ready until connected and verified; never again once draining.
    let readiness = Readiness::new();
    if let Some(addr) = opts.http_listen {
        let state = HttpState::new(readiness.clone(), metrics.registry());
        if let Err(e) = http::serve(addr, state).await {
            fail(format!("--http-listen {addr}: {e}"), telemetry);
        }
    }
    let bound = opts.stop_bound();
    let shutdown = CancellationToken::new();
    let reaper = Reaper::new(opts)
        .with_metrics(metrics)
        .with_readiness(readiness.clone());
    let handle = match reaper.start(shutdown.clone()).await {
        Ok(h) => h,
        Err(e) => fail(format!("{e:#}"), telemetry),
    };
    // The reaper's own stop ends within its drain timeout; this is the
    // backstop, and the second signal's way out.
    let signals = stop::phased(bound, |why| {
        tracing::error!("shutdown: {why}; exiting with the actions in progress unfinished");
    });
    tokio::spawn(async move {
        signals.cancelled().await;
        readiness.set_draining();
        shutdown.cancel();
    });
    match handle.wait().await {
        Ok(()) => telemetry.shutdown(),
        Err(e) => fail(format!("{e:#}"), telemetry),
    }
}
