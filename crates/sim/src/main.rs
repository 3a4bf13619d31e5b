//! `leasehold-sim`: a deterministic OpenAI-compatible model server plus a small
//! web (SearxNG-style `/search`, `/page/...`) and an effects sink, all on one
//! port, for the offline demo and the tests.
//!
//! Routes are assembled from one module per concern: [`model`] serves
//! `/v1/chat/completions` and `/stats`, [`web`] serves `/search` and `/page/...`,
//! [`effects`] serves `/effects`.

use clap::Parser;

mod effects;
mod model;
mod web;

/// Command-line options. Every flag also reads `LH_SIM_<FLAG>`.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "leasehold-sim",
    version,
    about = "Deterministic OpenAI-compatible model server, web and effects sink for leasehold's demo and tests"
)]
pub struct Args {
    /// Address to listen on, e.g. 127.0.0.1:8089 (port 0 picks a free port; the bound address is printed on stdout as `listening on ADDR`).
    #[arg(long, env = "LH_SIM_LISTEN", default_value = "127.0.0.1:8089")]
    pub listen: String,
    /// Seed of every deterministic choice (same seed + same request = same answer).
    #[arg(long, env = "LH_SIM_SEED", default_value_t = 0)]
    pub seed: u64,
    /// JSON file of fault rules (see the model module docs).
    #[arg(long, env = "LH_SIM_FAULTS")]
    pub faults: Option<std::path::PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let app = model::router(&args)?
        .merge(web::router(&args)?)
        .merge(effects::router(&args)?);
    let listener = tokio::net::TcpListener::bind(&args.listen).await?;
    println!("listening on {}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}
