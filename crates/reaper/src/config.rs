//! Reaper configuration. Every flag also reads `LH_<FLAG>` (e.g.
//! `--interval 3s` or `LH_INTERVAL=3s`); durations are written like `500ms`,
//! `3s`, `2m`.
//!
//! | flag | default | meaning |
//! |---|---|---|
//! | `--reaper-id` | unique per process | name in logs and metrics |
//! | `--max-stale-reclaims` | 3 | a job whose workers stopped this often while running it is poison (keep it equal to the workers' value) |
//! | `--interval` | 10s | sweep period over the index of active jobs (ended sessions, hung attempts, stranded waits, metrics); schedules are re-read at least this often (their ticks fire at their time) |
//! | `--stranded-grace` | 60s | how long past its due time a waiting job may go unclaimed before its ticket is replaced |
//! | `--probe-interval` | 500ms | how often every live worker is pinged; a closed connection ends its session at once (0: off, rely on the session timeout) |
//! | `--clock-skew` | 2s | how far apart two hosts' clocks may be (attempt deadlines only) |
//! | `--retention` | 7d | how long a finished job (record, events, artifact, effects) is kept after its last write; 0 keeps everything |
//! | `--retention-kind` | none | per-kind retention, e.g. `echo=1h,research=30d` |
//! | `--drain-timeout` | 10s | at SIGTERM, how long the actions in progress may take; then the reaper exits (non-zero) whatever NATS does, within drain + 1s |
//! | `--transcript-retention` | unset | remove a finished job's transcript (`journal` and `tool` events) this long after it finished; unset: it goes with the job |
//!
//! Plus the NATS variables of every binary (`NATS_URL`, credentials, TLS,
//! `LH_PREFIX`).

use std::time::Duration;

use clap::Parser;
use leasehold_core::time::parse_duration;
use leasehold_store::NatsArgs;

/// `leasehold-reaper` options.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "leasehold-reaper",
    version,
    about = "leasehold reaper: notices crashed workers at once and re-offers their jobs, dead-letters poison jobs and jobs past max deliveries, replaces lost tickets, exports fleet metrics; safe to run more than one",
    long_about = None
)]
pub struct Options {
    #[command(flatten)]
    pub nats: NatsArgs,
    /// Name of this replica in logs and metrics. Default: a unique id per process.
    #[arg(long, env = "LH_REAPER_ID")]
    pub reaper_id: Option<String>,
    /// A running job whose lease expired after this many stale reclaims is
    /// dead-lettered as poison (the workers refuse to reclaim it further).
    #[arg(long, env = "LH_MAX_STALE_RECLAIMS", default_value_t = 3)]
    pub max_stale_reclaims: u32,
    /// Sweep period: poison jobs, stranded runs, unfinished dead-lettering,
    /// metrics; the schedules are re-read at least this often (their ticks
    /// fire at their time, not at a sweep).
    #[arg(long, env = "LH_INTERVAL", default_value = "10s", value_parser = parse_duration)]
    pub interval: Duration,
    /// How long past its due time a waiting job may go unclaimed before its
    /// work ticket is replaced by a fresh one (a lost ticket, or one past the
    /// consumer's max deliveries whose advisory was lost).
    #[arg(long, env = "LH_STRANDED_GRACE", default_value = "60s", value_parser = parse_duration)]
    pub stranded_grace: Duration,
    /// How often every live worker process is pinged. A ping the server
    /// answers with "no responders" means the process's connection closed
    /// (a crash): its session is ended at once instead of after its
    /// timeout. 0 turns probing off.
    #[arg(long, env = "LH_PROBE_INTERVAL", default_value = "500ms", value_parser = parse_duration)]
    pub probe_interval: Duration,
    /// How far apart two hosts' clocks may be: an attempt deadline written
    /// by a worker is trusted as passed only this long after it says.
    #[arg(long, env = "LH_CLOCK_SKEW", default_value = "2s", value_parser = parse_duration)]
    pub clock_skew: Duration,
    /// How long a finished job is kept after its last write: then its
    /// artifact, effects-ledger entries, payloads, record and, last, its
    /// events are removed, in that order (a dead job: at least as long as
    /// its dead letter lives). 0 keeps everything.
    #[arg(long, env = "LH_RETENTION", default_value = "7d", value_parser = parse_duration)]
    pub retention: Duration,
    /// Retention per kind, comma-separated `kind=duration` (e.g.
    /// `echo=1h,research=30d`); other kinds get --retention.
    #[arg(long, env = "LH_RETENTION_KIND", value_delimiter = ',', value_parser = parse_kind_retention)]
    pub retention_kind: Vec<(String, Duration)>,
    /// Remove a finished job's transcript (its `journal` and `tool` events:
    /// every model message and tool result) this long after it finished,
    /// e.g. `0s` or `1d`. The record, checkpoints, terminal event and
    /// artifact stay until --retention. Unset: the transcript goes with
    /// the job.
    #[arg(long, env = "LH_TRANSCRIPT_RETENTION", value_parser = parse_duration)]
    pub transcript_retention: Option<Duration>,
    /// At SIGTERM/SIGINT, how long the actions in progress may take to
    /// finish. Then the reaper exits whatever NATS does, non-zero, leaving
    /// them to another replica or its next start (every action is
    /// conditional, so one cut short is simply done again). A stop takes
    /// at most this + 1s.
    #[arg(long, env = "LH_DRAIN_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub drain_timeout: Duration,
    /// Serve /healthz, /readyz and /metrics on this address (e.g.
    /// `0.0.0.0:9091`). No HTTP server when unset.
    #[arg(long, env = "LH_HTTP_LISTEN")]
    pub http_listen: Option<std::net::SocketAddr>,
}

/// `kind=duration`.
fn parse_kind_retention(s: &str) -> Result<(String, Duration), String> {
    let (k, d) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?}: write kind=duration, e.g. echo=1h"))?;
    let k = k.trim();
    if k.is_empty() {
        return Err(format!("{s:?}: the kind is missing"));
    }
    Ok((k.to_string(), parse_duration(d.trim())?))
}

impl Options {
    /// Options for tests and the demo: defaults, the given server and prefix.
    pub fn local(url: &str, prefix: &str) -> Self {
        let mut o = Options::parse_from(["leasehold-reaper"]);
        o.nats = NatsArgs::local(url, prefix);
        o
    }

    /// The longest a stop (SIGTERM/SIGINT) takes before the process exits.
    pub fn stop_bound(&self) -> Duration {
        self.drain_timeout + Duration::from_secs(1)
    }

    /// Rejects settings that cannot work, saying what to change.
    pub fn validate(&self) -> Result<(), String> {
        if self.interval < Duration::from_millis(50) {
            return Err("--interval must be at least 50ms".into());
        }
        if self.max_stale_reclaims == 0 {
            return Err(
                "--max-stale-reclaims must be at least 1 (the workers' value, 3 by default)".into(),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_durations() {
        let o = Options::parse_from(["leasehold-reaper"]);
        assert_eq!(
            (o.max_stale_reclaims, o.interval, o.stranded_grace),
            (3, Duration::from_secs(10), Duration::from_secs(60))
        );
        let o = Options::parse_from([
            "leasehold-reaper",
            "--interval",
            "500ms",
            "--stranded-grace",
            "3s",
        ]);
        assert_eq!(
            (o.interval, o.stranded_grace),
            (Duration::from_millis(500), Duration::from_secs(3))
        );
        assert!(o.validate().is_ok());
        assert!(
            Options::parse_from(["leasehold-reaper", "--interval", "1ms"])
                .validate()
                .is_err()
        );
    }
}
