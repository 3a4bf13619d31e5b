//! `leasehold-reaper`: the reaper binary. See `leasehold-reaper --help`.

use clap::{CommandFactory, FromArgMatches};
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
    // Every variable the reaper reads is a flag's (listed with `[env: ...]`)
    // except the log filter.
    let matches = Options::command()
        .after_help(format!(
            "Logging:\n  {:<32} log filter, e.g. info or leasehold_reaper=debug [default: info]",
            "RUST_LOG"
        ))
        .get_matches();
    let opts = Options::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    if let Err(e) = opts.validate() {
        eprintln!("error: {e}");
        std::process::exit(2);
    }
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
