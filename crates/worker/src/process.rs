//! A worker as a process: metrics and probes, signals, drain. Shared by
//! `leasehold-worker` and every worker built with the `leasehold` crate.

use std::net::SocketAddr;

use crate::metrics::Metrics;
use leasehold_telemetry::http::{self, HttpState};
use leasehold_telemetry::{stop, Readiness};
use tokio_util::sync::CancellationToken;

use crate::service::{NotHandedBack, Worker};

/// Starts `worker` and runs it until SIGTERM or SIGINT, then drains and
/// hands back ([`crate::service`]); the process exits within
/// [`Options::stop_bound`](crate::Options::stop_bound) whatever NATS does,
/// at once on a second signal. With `http_listen`, serves `/healthz`,
/// `/readyz` (ready once connected and verified, never again once
/// draining) and `/metrics` there.
pub async fn run(worker: Worker, http_listen: Option<SocketAddr>) -> anyhow::Result<()> {
    let metrics = Metrics::new();
    let readiness = Readiness::new();
    if let Some(addr) = http_listen {
        let state = HttpState::new(readiness.clone(), metrics.registry());
        http::serve(addr, state)
            .await
            .map_err(|e| anyhow::anyhow!("--http-listen {addr}: {e}"))?;
    }
    let bound = worker.options().stop_bound();
    let shutdown = CancellationToken::new();
    let handle = worker
        .with_metrics(metrics)
        .with_readiness(readiness.clone())
        .start(shutdown.clone())
        .await?;
    // The worker's own stop ends within its hand-back timeout; this is the
    // backstop, and the second signal's way out.
    let unreturned = handle.unreturned();
    let signals = stop::phased(bound, move |why| {
        let jobs = unreturned();
        if jobs.is_empty() {
            tracing::warn!("shutdown: {why}; no job held; exiting now");
        } else {
            let e = NotHandedBack {
                jobs,
                why: why.to_string(),
            };
            tracing::error!("{e}; exiting now");
        }
    });
    tokio::spawn(async move {
        signals.cancelled().await;
        readiness.set_draining();
        shutdown.cancel();
    });
    handle.wait().await
}
