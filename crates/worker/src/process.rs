//! A worker as a process: metrics and probes, signals, drain. Shared by
//! `leasehold-worker` and every worker built with the `leasehold` crate.

use std::net::SocketAddr;
use std::sync::Arc;

use leasehold_telemetry::http::{self, HttpState};
use leasehold_telemetry::metrics::Metrics;
use leasehold_telemetry::{observe, Readiness};
use tokio_util::sync::CancellationToken;

use crate::service::Worker;

/// Starts `worker` and runs it until SIGTERM or SIGINT, then drains. With
/// `http_listen`, serves `/healthz`, `/readyz` (ready once connected and
/// verified, never again once draining) and `/metrics` there.
pub async fn run(worker: Worker, http_listen: Option<SocketAddr>) -> anyhow::Result<()> {
    let metrics = Metrics::new();
    // The model, tool and research layers report through the process's observer.
    observe::install(Arc::new(metrics.clone()));
    let readiness = Readiness::new();
    if let Some(addr) = http_listen {
        let state = HttpState::new(readiness.clone(), metrics.registry());
        http::serve(addr, state)
            .await
            .map_err(|e| anyhow::anyhow!("--http-listen {addr}: {e}"))?;
    }
    let shutdown = CancellationToken::new();
    let handle = worker
        .with_metrics(metrics)
        .with_readiness(readiness.clone())
        .start(shutdown.clone())
        .await?;
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
    handle.wait().await
}
