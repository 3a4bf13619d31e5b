//! `leasehold-console`: the operator console (jobs, a job's timeline and
//! report, the fleet, dead letters, reviews and actions in a browser) and
//! the clients' stream (`/v1/jobs/{id}`, `/v1/jobs/{id}/events` as
//! Server-Sent Events, `/v1/jobs/{id}/result`).
//!
//! Everything shown comes from the index of active jobs, the records, the
//! events and the streams' own counts, never a scan of history; live parts
//! follow KV watches and ordered consumers of the events. Its NATS user
//! reads; actions go through a second connection under an operator user
//! when one is configured (`--operator-nats-user`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use leasehold_store::NatsArgs;

mod actions;
mod api;
mod app;
mod auth;
mod cache;
mod charts;
mod chartview;
mod feed;
mod fleet;
mod metrics;
mod ops;
mod pages;
mod render;
mod sampler;
mod search;
mod streams;
mod svg;
mod waterfall;
mod waterfall_page;
mod waterfall_svg;

#[derive(Parser, Debug, Clone)]
#[command(
    name = "leasehold-console",
    version,
    about = "The operator console and the clients' job stream (HTTP, Server-Sent Events)"
)]
pub struct Args {
    #[command(flatten)]
    pub nats: NatsArgs,
    /// Where the console serves (HTTP). Without any token or trusted header
    /// it must be a loopback address: auth is off only there.
    #[arg(long, env = "LH_CONSOLE_HTTP_LISTEN", default_value = "127.0.0.1:8090")]
    pub http_listen: SocketAddr,
    /// A bearer token (or the login form's) that may read everything.
    #[arg(
        long = "token",
        id = "read_token",
        env = "LH_CONSOLE_TOKEN",
        hide_env_values = true
    )]
    pub read_token: Option<String>,
    /// A bearer token that may read and act (cancel, review, dead letters).
    #[arg(long, env = "LH_CONSOLE_OPERATOR_TOKEN", hide_env_values = true)]
    pub operator_token: Option<String>,
    /// A header set by an authenticating proxy in front of the console,
    /// naming the caller (e.g. `X-Forwarded-User`); trusted as it is, so
    /// only use it behind such a proxy.
    #[arg(long, env = "LH_CONSOLE_TRUSTED_HEADER")]
    pub trusted_header: Option<String>,
    /// Callers named by the trusted header who may act (comma-separated;
    /// `*` for everyone the proxy lets through).
    #[arg(long, env = "LH_CONSOLE_OPERATORS", value_delimiter = ',')]
    pub operators: Vec<String>,
    /// NATS user for actions (with --operator-nats-password), e.g.
    /// lh-operator. Without an operator connection, a console that reads as
    /// a NATS user (lh-console) refuses every action, saying why; one
    /// connected without credentials acts on its own connection.
    #[arg(long, env = "LH_CONSOLE_OPERATOR_NATS_USER")]
    pub operator_nats_user: Option<String>,
    /// Password of --operator-nats-user.
    #[arg(
        long,
        env = "LH_CONSOLE_OPERATOR_NATS_PASSWORD",
        hide_env_values = true
    )]
    pub operator_nats_password: Option<String>,
    /// Credentials file for actions (instead of a user and password).
    #[arg(long, env = "LH_CONSOLE_OPERATOR_NATS_CREDS")]
    pub operator_nats_creds: Option<PathBuf>,
    /// Reply-inbox prefix of the operator connection.
    #[arg(
        long,
        env = "LH_CONSOLE_OPERATOR_INBOX_PREFIX",
        default_value = "_INBOX_operator"
    )]
    pub operator_inbox_prefix: String,
    /// The largest page a request may ask for (`limit`); more is refused.
    #[arg(long, env = "LH_CONSOLE_PAGE_MAX", default_value_t = 500)]
    pub page_max: usize,
    /// Further values never to show (comma-separated), besides the
    /// console's own tokens and passwords and `LH_API_KEY` when set.
    #[arg(
        long,
        env = "LH_CONSOLE_REDACT",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub redact: Vec<String>,
    /// At SIGTERM/SIGINT, how long open requests and event streams may go
    /// on before they are closed. A stop takes at most this + 1s; a second
    /// signal exits at once.
    #[arg(long, env = "LH_CONSOLE_DRAIN_TIMEOUT", default_value = "5s", value_parser = leasehold_core::time::parse_duration)]
    pub drain_timeout: Duration,
    /// Live streams (Server-Sent Events: /v1/jobs/{id}/events, /jobs/live,
    /// /jobs/{id}/live, /fleet/live) one caller may hold at once; more get
    /// 429. A caller is its token or proxy user, or its IP address when
    /// auth is off.
    #[arg(long, env = "LH_CONSOLE_STREAMS_PER_CALLER", default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    pub streams_per_caller: u32,
    /// The record cache's bound in bytes (each record's encoded size plus
    /// 256): beyond it the least recently used records go, and are read
    /// from the store when shown again. A number of bytes, or with KiB,
    /// MiB or GiB.
    #[arg(long, env = "LH_CONSOLE_RECORD_CACHE_BYTES", default_value = "64MiB", value_parser = parse_bytes)]
    pub record_cache_bytes: usize,
    /// The record cache's bound in records.
    #[arg(
        long,
        env = "LH_CONSOLE_RECORD_CACHE_RECORDS",
        default_value_t = 100_000
    )]
    pub record_cache_records: usize,
    /// Bulk actions (bulk-cancel, bulk-replay, bulk-purge) that may run at
    /// once; another is refused (429) until one ends.
    #[arg(long, env = "LH_CONSOLE_BULK_MAX", default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    pub bulk_max: u32,
    /// The fleet's charts' interval: one sample per interval, 360 kept
    /// (an hour at 10s), whole seconds.
    #[arg(long, env = "LH_CONSOLE_CHART_INTERVAL", default_value = "10s", value_parser = chart_interval)]
    pub chart_interval: Duration,
    /// The job waterfalls' cache bound in bytes (the models of recently
    /// shown jobs, so a refresh reads only the events since; 0: off, every
    /// request reads the job's events from the start).
    #[arg(long, env = "LH_CONSOLE_WATERFALL_CACHE_BYTES", default_value = "32MiB", value_parser = parse_bytes)]
    pub waterfall_cache_bytes: usize,
    /// Whether the console keeps a view of the index of active jobs in
    /// memory (`on`, `off`; also true/false, yes/no, 1/0). On: exact counts
    /// on the jobs and fleet pages, and a page is read from memory; it
    /// costs ~0.5 KiB per active job and a read of the whole index at
    /// start (seconds at a million active jobs), during which pages work as
    /// if it were off. Off: nothing per active job and nothing read at
    /// start; the jobs page reads its rows from the index's end and counts
    /// "at least N", and the fleet page does not count jobs per kind and
    /// status.
    #[arg(
        long,
        env = "LH_CONSOLE_INDEX_VIEW",
        default_value = "on",
        action = clap::ArgAction::Set,
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    pub index_view: bool,
}

/// A chart interval: a duration of whole seconds, 1s to 10min.
fn chart_interval(s: &str) -> Result<Duration, String> {
    let d = leasehold_core::time::parse_duration(s)?;
    if d.subsec_nanos() != 0 || d < Duration::from_secs(1) || d > Duration::from_secs(600) {
        return Err(format!(
            "{s:?}: use whole seconds from 1s to 10m (e.g. 10s)"
        ));
    }
    Ok(d)
}

/// A size: whole bytes, or a whole number with `KiB`, `MiB` or `GiB`.
fn parse_bytes(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let (n, unit) = match s.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => s.split_at(i),
        None => (s, ""),
    };
    let mult: usize = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        u => {
            return Err(format!(
                "unit {u:?}: use bytes, KiB, MiB or GiB (e.g. 64MiB)"
            ))
        }
    };
    n.parse::<usize>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .ok_or_else(|| format!("{s:?} is not a size (e.g. 67108864 or 64MiB)"))
}

fn main() {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    if let Err(e) = auth::check_config(&args) {
        eprintln!("error: {e}");
        std::process::exit(2);
    }
    let rt = tokio::runtime::Runtime::new().expect("tokio runtime");
    let code = rt.block_on(async move {
        match run(args).await {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("error: {e:#}");
                1
            }
        }
    });
    std::process::exit(code);
}

async fn run(args: Args) -> anyhow::Result<()> {
    let app = Arc::new(app::App::start(args.clone()).await?);
    tokio::spawn(fleet::refresh(app.clone()));
    tokio::spawn(sampler::run(app.clone()));
    let router = app::router(app);
    let listener = tokio::net::TcpListener::bind(args.http_listen).await?;
    let addr = listener.local_addr()?;
    // Tests and the demo read this line.
    println!("console listening on http://{addr}");
    tracing::info!(%addr, "console listening");
    let drain = args.drain_timeout;
    let graceful = leasehold_telemetry::stop::phased(drain + Duration::from_secs(1), |why| {
        tracing::error!("shutdown: {why}; exiting now");
    });
    // The peer's address is who a caller is without auth (its live streams).
    let serve = axum::serve(
        listener,
        router.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(graceful.clone().cancelled_owned());
    // Event streams never end by themselves: the drain timeout closes them.
    let drained = async {
        graceful.cancelled().await;
        tokio::time::sleep(drain).await;
    };
    tokio::select! {
        r = serve => r?,
        _ = drained => tracing::info!(
            "shutdown: --drain-timeout passed; closing the open requests and event streams"
        ),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::Args;
    use clap::{CommandFactory, Parser};

    #[test]
    fn the_command_line_is_well_formed() {
        Args::command().debug_assert();
    }

    #[test]
    fn sizes_parse_in_bytes_or_binary_units() {
        assert_eq!(super::parse_bytes("64MiB"), Ok(64 << 20));
        assert_eq!(super::parse_bytes("4096"), Ok(4096));
        assert_eq!(super::parse_bytes("2 KiB"), Ok(2048));
        assert!(super::parse_bytes("64MB")
            .unwrap_err()
            .contains("KiB, MiB or GiB"));
        assert!(super::parse_bytes("lots").is_err());
        assert!(super::parse_bytes("").is_err());
    }

    #[test]
    fn the_index_view_is_on_by_default_off_when_asked_and_a_bad_value_says_so() {
        let parse =
            |a: &[&str]| Args::try_parse_from(std::iter::once("c").chain(a.iter().copied()));
        assert!(parse(&[]).unwrap().index_view);
        assert!(!parse(&["--index-view", "off"]).unwrap().index_view);
        assert!(parse(&["--index-view", "on"]).unwrap().index_view);
        let err = parse(&["--index-view", "maybe"]).unwrap_err().to_string();
        assert!(
            err.contains("--index-view") && err.contains("maybe"),
            "{err}"
        );
    }

    #[test]
    fn auth_is_off_only_on_loopback() {
        let parse = |a: &[&str]| {
            Args::try_parse_from(std::iter::once("c").chain(a.iter().copied())).unwrap()
        };
        assert!(super::auth::check_config(&parse(&[])).is_ok());
        assert!(super::auth::check_config(&parse(&["--http-listen", "0.0.0.0:8090"])).is_err());
        assert!(super::auth::check_config(&parse(&[
            "--http-listen",
            "0.0.0.0:8090",
            "--token",
            "0123456789abcdef"
        ]))
        .is_ok());
        assert!(super::auth::check_config(&parse(&["--token", "short"])).is_err());
        assert!(super::auth::check_config(&parse(&["--operators", "ann"])).is_err());
    }
}
