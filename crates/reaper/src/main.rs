//! `leasehold-reaper`: the reaper binary. See `leasehold-reaper --help`.

use clap::Parser;
use leasehold_reaper::{Options, Reaper};
use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let opts = Options::parse();
    let shutdown = CancellationToken::new();
    let handle = match Reaper::new(opts).start(shutdown.clone()).await {
        Ok(h) => h,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(1);
        }
    };
    tokio::spawn(async move {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: shutting down"),
        }
        shutdown.cancel();
    });
    if let Err(e) = handle.wait().await {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
