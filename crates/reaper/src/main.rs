//! `leasehold-reaper`: the reaper binary. See `leasehold-reaper --help`.
//!
//! Logs go to stderr (`LH_LOG_FORMAT=json|text`, `RUST_LOG`); traces to an
//! OTLP/gRPC collector when `OTEL_EXPORTER_OTLP_ENDPOINT` is set; with
//! `--http-listen` (`LH_HTTP_LISTEN`), `/healthz`, `/readyz` and `/metrics`
//! (every series labelled `replica=<reaper id>`).

use std::sync::atomic::Ordering;
use std::time::Duration;

use clap::{CommandFactory, FromArgMatches};
use leasehold_reaper::{Handle, Options, Reaper};
use leasehold_telemetry::http::{self, HttpState};
use leasehold_telemetry::metrics::{FleetSnapshot, ReaperMetrics};
use leasehold_telemetry::{redact_text, trace, Readiness};
use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() {
    // Every variable the reaper reads is a flag's (listed with `[env: ...]`)
    // except the log and trace settings.
    let matches = Options::command()
        .after_help(format!(
            "Logging:\n  {:<32} log filter, e.g. info or leasehold_reaper=debug [default: info]\n  {:<32} json or text [default: text]\n  {:<32} OTLP/gRPC collector for traces (none when unset)",
            "RUST_LOG", "LH_LOG_FORMAT", "OTEL_EXPORTER_OTLP_ENDPOINT"
        ))
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
    let shutdown = CancellationToken::new();
    let handle = match Reaper::new(opts).start(shutdown.clone()).await {
        Ok(h) => h,
        Err(e) => fail(format!("{e:#}"), telemetry),
    };
    // start() returns once it is connected and has verified the layout.
    readiness.set_connected(true);
    readiness.set_layout_ok(true);
    tokio::spawn(export_metrics(&handle, metrics));
    let draining = readiness.clone();
    tokio::spawn(async move {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: shutting down"),
        }
        draining.set_draining();
        shutdown.cancel();
    });
    match handle.wait().await {
        Ok(()) => telemetry.shutdown(),
        Err(e) => fail(format!("{e:#}"), telemetry),
    }
}

/// Feeds the Prometheus metrics from what the reaper already keeps: the
/// fleet gauges from each sweep's snapshot, this replica's counters from
/// its `Stats` (as increments, checked every second). Ends with the reaper.
fn export_metrics(handle: &Handle, m: ReaperMetrics) -> impl std::future::Future<Output = ()> {
    let mut sweeps = handle.metrics_watch();
    let stats = handle.stats.clone();
    async move {
        let mut seen = [0u64; 5];
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                changed = sweeps.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    let s = sweeps.borrow_and_update().clone();
                    m.fleet(&FleetSnapshot {
                        jobs: s.jobs,
                        // The sweep counts queued and running together.
                        queued: None,
                        in_flight: s.in_flight,
                        parked: s.parked,
                        oldest_in_flight_age: s
                            .oldest_in_flight_age_s
                            .map(|a| Duration::from_secs_f64(a.max(0.0))),
                        dead_letters: s.dead_letters_by_class,
                    });
                }
                _ = tick.tick() => {}
            }
            let now = [
                stats.sweeps.load(Ordering::Relaxed),
                stats.recoveries.load(Ordering::Relaxed),
                stats.poison.load(Ordering::Relaxed),
                stats.max_deliveries.load(Ordering::Relaxed),
                stats.advisories.load(Ordering::Relaxed),
            ];
            let d: Vec<u64> = now
                .iter()
                .zip(seen)
                .map(|(n, s)| n.saturating_sub(s))
                .collect();
            m.sweeps(d[0]);
            m.recovered(d[1]);
            m.dead_lettered("poison", d[2]);
            m.dead_lettered("max_deliveries", d[3]);
            m.advisories(d[4]);
            seen = now;
        }
    }
}
