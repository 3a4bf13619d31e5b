//! Worker configuration. Every flag also reads `LH_<FLAG>` (e.g. `--lease 3s`
//! or `LH_LEASE=3s`); durations are written like `500ms`, `3s`, `2m`.
//!
//! | flag | default | meaning |
//! |---|---|---|
//! | `--worker-id` | unique per process | stable identity (e.g. the pod name): jobs this identity held in an earlier process are reclaimed at start |
//! | `--concurrency` | 16 | jobs run at once; never more tickets are pulled than free slots |
//! | `--lease` | 180s | how long a claim stays valid without a heartbeat |
//! | `--heartbeat` | 60s | how often the lease is extended |
//! | `--drain-timeout` | 30s | at SIGTERM, how long in-flight jobs may finish before they are handed back |
//! | `--pull-expires` | 1s | lifetime of one pull request (short, so a paused worker cannot hold work hostage) |
//! | `--kinds` | `research` | kinds served |
//! | `--dev-kinds` | off | allows the test kinds (`echo`, `sleep`, `fail`, `crash`, `deliver`) in `--kinds` |
//! | `--max-submission-bytes` | 1048576 | larger submissions are rejected |
//! | `--max-stale-reclaims` | 3 | beyond this, a job is left to the reaper as poison |
//! | `--max-attempts`, `--retry-base`, `--retry-cap` | 5, 1s, 5m | job-level retry defaults |

use std::time::Duration;

use clap::Parser;
use leasehold_core::retry::RetryPolicy;
use leasehold_core::time::parse_duration;
use leasehold_store::NatsArgs;

/// The built-in kinds for tests, the demo and benchmarks; a worker serves
/// them only with `--dev-kinds`.
pub const DEV_KINDS: &[&str] = &["echo", "sleep", "fail", "crash", "deliver"];

/// `leasehold-worker` options.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "leasehold-worker",
    version,
    about = "Stateless leasehold worker: pulls tickets, claims jobs, heartbeats, runs them, hands them back on shutdown",
    long_about = None
)]
pub struct Options {
    #[command(flatten)]
    pub nats: NatsArgs,
    /// Stable identity (e.g. the pod name). Jobs this identity owned in an
    /// earlier process are reclaimed at start without waiting for their
    /// leases. Default: a unique id per process.
    #[arg(long, env = "LH_WORKER_ID")]
    pub worker_id: Option<String>,
    /// Jobs run at once (free slots bound every pull).
    #[arg(long, env = "LH_CONCURRENCY", default_value_t = 16)]
    pub concurrency: usize,
    /// Lease of a claim without heartbeat.
    #[arg(long, env = "LH_LEASE", default_value = "180s", value_parser = parse_duration)]
    pub lease: Duration,
    /// Heartbeat interval (must be shorter than the lease; a third of it is a good choice).
    #[arg(long, env = "LH_HEARTBEAT", default_value = "60s", value_parser = parse_duration)]
    pub heartbeat: Duration,
    /// At SIGTERM/SIGINT, how long in-flight jobs may run on before they are handed back.
    #[arg(long, env = "LH_DRAIN_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub drain_timeout: Duration,
    /// Lifetime of one pull request.
    #[arg(long, env = "LH_PULL_EXPIRES", default_value = "1s", value_parser = parse_duration)]
    pub pull_expires: Duration,
    /// Kinds served, comma-separated. The test kinds (echo, sleep, fail,
    /// crash, deliver) are served only with --dev-kinds as well.
    #[arg(
        long,
        env = "LH_KINDS",
        value_delimiter = ',',
        default_value = "research"
    )]
    pub kinds: Vec<String>,
    /// Allow the test kinds in --kinds (and LH_RESEARCH_CRASH_AT). For tests,
    /// the demo and benchmarks only: `crash` aborts the worker process.
    #[arg(
        long,
        env = "LH_DEV_KINDS",
        action = clap::ArgAction::SetTrue,
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    pub dev_kinds: bool,
    /// Submissions larger than this many bytes are rejected.
    #[arg(long, env = "LH_MAX_SUBMISSION_BYTES", default_value_t = leasehold_core::spec::DEFAULT_MAX_BYTES)]
    pub max_submission_bytes: usize,
    /// A job already reclaimed this many times after lost leases is left to the reaper.
    #[arg(long, env = "LH_MAX_STALE_RECLAIMS", default_value_t = 3)]
    pub max_stale_reclaims: u32,
    /// Attempts of a job (the first included) before a retryable error fails it.
    #[arg(long, env = "LH_MAX_ATTEMPTS", default_value_t = 5)]
    pub max_attempts: u32,
    /// First job-level retry delay ceiling (doubles per attempt, full jitter).
    #[arg(long, env = "LH_RETRY_BASE", default_value = "1s", value_parser = parse_duration)]
    pub retry_base: Duration,
    /// Cap of the job-level retry delay.
    #[arg(long, env = "LH_RETRY_CAP", default_value = "5m", value_parser = parse_duration)]
    pub retry_cap: Duration,
}

impl Options {
    /// Options for in-process workers of tests: defaults, the given server
    /// and prefix, and the test kinds allowed (`--dev-kinds`).
    pub fn local(url: &str, prefix: &str) -> Self {
        let mut o = Options::parse_from(["leasehold-worker"]);
        o.nats = NatsArgs::local(url, prefix);
        o.dev_kinds = true;
        o
    }

    /// Rejects contradictory settings with a message saying what to change.
    pub fn validate(&self) -> Result<(), String> {
        if self.concurrency == 0 {
            return Err("--concurrency must be at least 1".into());
        }
        if self.heartbeat >= self.lease {
            return Err(format!(
                "--heartbeat ({}) must be shorter than --lease ({}); a third of the lease is a good choice",
                leasehold_core::time::format_duration(self.heartbeat),
                leasehold_core::time::format_duration(self.lease)
            ));
        }
        if self.pull_expires < Duration::from_millis(100) {
            return Err("--pull-expires must be at least 100ms".into());
        }
        if self.kinds.is_empty() {
            return Err("--kinds must name at least one kind".into());
        }
        self.check_dev_kinds()?;
        Ok(())
    }

    /// Test kinds are served only when `--dev-kinds` allows them.
    pub fn check_dev_kinds(&self) -> Result<(), String> {
        let dev: Vec<&str> = self
            .kinds
            .iter()
            .map(String::as_str)
            .filter(|k| DEV_KINDS.contains(k))
            .collect();
        if !dev.is_empty() && !self.dev_kinds {
            return Err(format!(
                "--kinds lists test kinds ({}); they are served only with --dev-kinds \
                 (LH_DEV_KINDS=1), never in production: `crash` aborts the worker",
                dev.join(", ")
            ));
        }
        Ok(())
    }

    pub fn retry_policy(&self) -> RetryPolicy {
        RetryPolicy {
            max_attempts: self.max_attempts,
            base: self.retry_base,
            cap: self.retry_cap,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_kinds_need_the_dev_flag() {
        let o = Options::parse_from(["leasehold-worker"]);
        assert_eq!(o.kinds, vec!["research".to_string()]);
        assert!(!o.dev_kinds);
        assert!(o.validate().is_ok());
        let o = Options::parse_from(["leasehold-worker", "--kinds", "research,crash"]);
        let e = o.validate().unwrap_err();
        assert!(e.contains("crash") && e.contains("--dev-kinds"), "{e}");
        let o = Options::parse_from(["leasehold-worker", "--kinds", "echo,crash", "--dev-kinds"]);
        assert!(o.validate().is_ok());
        assert!(Options::local("nats://127.0.0.1:4222", "lh").dev_kinds);
    }
}
