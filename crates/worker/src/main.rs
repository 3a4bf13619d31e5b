//! `leasehold-worker`: the stateless worker binary. See `leasehold-worker --help`.
//!
//! Logs go to stderr (`LH_LOG_FORMAT=json|text`, `RUST_LOG`); traces to an
//! OTLP/gRPC collector when `OTEL_EXPORTER_OTLP_ENDPOINT` is set; with
//! `--http-listen` (`LH_HTTP_LISTEN`), `/healthz`, `/readyz` and `/metrics`.

use std::sync::Arc;

use clap::Parser;
use leasehold_telemetry::http::{self, HttpState};
use leasehold_telemetry::metrics::Metrics;
use leasehold_telemetry::{observe, redact_text, trace, Readiness};
use leasehold_worker::{Options, Worker};
use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() {
    let telemetry = trace::init("leasehold-worker");
    let opts = Options::parse();
    let fail = |what: String, telemetry: trace::Guard| -> ! {
        eprintln!("error: {}", redact_text(&what));
        telemetry.shutdown();
        std::process::exit(1);
    };
    let metrics = Metrics::new();
    // The model, tool and research layers report through the process's observer.
    observe::install(Arc::new(metrics.clone()));
    // Not ready until connected and verified; never again once draining.
    let readiness = Readiness::new();
    if let Some(addr) = opts.http_listen {
        let state = HttpState::new(readiness.clone(), metrics.registry());
        if let Err(e) = http::serve(addr, state).await {
            fail(format!("--http-listen {addr}: {e}"), telemetry);
        }
    }
    let shutdown = CancellationToken::new();
    let handle = match Worker::new(opts).start(shutdown.clone()).await {
        Ok(h) => h,
        Err(e) => fail(format!("{e:#}"), telemetry),
    };
    // start() returns once it is connected, has verified the layout and pulls.
    readiness.set_connected(true);
    readiness.set_layout_ok(true);
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
