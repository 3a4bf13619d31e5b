//! Worker configuration. Every flag also reads `LH_<FLAG>` (e.g.
//! `--session-timeout 3s` or `LH_SESSION_TIMEOUT=3s`); durations are written like `500ms`, `3s`, `2m`.
//!
//! | flag | default | meaning |
//! |---|---|---|
//! | `--worker-id` | unique per process | stable identity (e.g. the pod name): jobs this identity held in an earlier process are reclaimed at start |
//! | `--concurrency` | 16 | jobs run at once; never more tickets are pulled than free slots |
//! | `--session-timeout` | 10s | a worker whose session is not renewed for this long has lost its jobs |
//! | `--session-renew` | timeout / 5 | how often the session is renewed (one write for the whole process) |
//! | `--attempt-timeout` | 6h | the longest one attempt may hold a job, even while the session lives |
//! | `--clock-skew` | 2s | how far apart two hosts' clocks may be (only attempt deadlines compare them) |
//! | `--index-after` | 1s | a job still running after this is entered in the index of active jobs and its ticket settled |
//! | `--drain-timeout` | 30s | at SIGTERM, how long in-flight jobs may finish before they are handed back |
//! | `--hand-back-timeout` | 15s | after the drain, how long handing jobs back may take; then the process exits whatever NATS does (it stops within drain + hand-back + 1s) |
//! | `--pull-expires` | 1s | lifetime of one pull request (short, so a paused worker cannot hold work hostage) |
//! | `--kinds` | `research` | kinds served |
//! | `--dev-kinds` | off | allows the test kinds (`echo`, `sleep`, `fail`, `crash`, `deliver`) in `--kinds` |
//! | `--max-submission-bytes` | 1048576 | larger submissions are rejected |
//! | `--max-stale-reclaims` | 3 | beyond this, a job is left to the reaper as poison |
//! | `--max-attempts`, `--retry-base`, `--retry-cap` | 5, 1s, 5m | job-level retry defaults |
//! | `--remote-kind` | none | `NAME=URL`: a kind served by an HTTP service through the worker protocol (docs/protocol.md) |
//! | `--remote-timeout`, `--remote-journal-page`, `--remote-max-body` | 30s, 256, 1 MiB | bounds of one call to a remote kind's service |

use std::time::Duration;

use clap::Parser;
use leasehold_core::retry::RetryPolicy;
use leasehold_core::time::parse_duration;
use leasehold_store::NatsArgs;

/// The built-in kinds for tests, the demo and benchmarks; a worker serves
/// them only with `--dev-kinds`.
pub const DEV_KINDS: &[&str] = &["echo", "sleep", "fail", "crash", "deliver", "fanout"];

/// `leasehold-worker` options.
#[derive(Parser, Debug, Clone)]
#[command(
    name = "leasehold-worker",
    version,
    about = "Stateless leasehold worker: pulls tickets, claims jobs, proves it is alive with one session, runs them, hands them back on shutdown",
    long_about = None
)]
pub struct Options {
    #[command(flatten)]
    pub nats: NatsArgs,
    /// Stable identity (e.g. the pod name). Jobs this identity owned in an
    /// earlier process are reclaimed at start without waiting for that
    /// process's session to time out. Default: a unique id per process.
    #[arg(long, env = "LH_WORKER_ID")]
    pub worker_id: Option<String>,
    /// Jobs run at once (free slots bound every pull).
    #[arg(long, env = "LH_CONCURRENCY", default_value_t = 16)]
    pub concurrency: usize,
    /// How long this process may go without renewing its session before it
    /// loses its jobs (they are re-offered to other workers). The server
    /// judges it (a TTL on the session key); no clocks are compared.
    #[arg(long, env = "LH_SESSION_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub session_timeout: Duration,
    /// How often the session is renewed (default: a fifth of the timeout).
    /// One write per interval for the whole process, whatever it runs.
    #[arg(long, env = "LH_SESSION_RENEW", value_parser = parse_duration)]
    pub session_renew: Option<Duration>,
    /// The longest one attempt may hold a job while this process lives: past
    /// it the attempt is stopped (a retryable error) and any worker may
    /// reclaim the job. A second line for an attempt that hangs.
    #[arg(long, env = "LH_ATTEMPT_TIMEOUT", default_value = "6h", value_parser = parse_duration)]
    pub attempt_timeout: Duration,
    /// How far apart two hosts' clocks may be. Only attempt deadlines written
    /// by other hosts are compared with this host's clock, and only trusted
    /// as passed this long after they say.
    #[arg(long, env = "LH_CLOCK_SKEW", default_value = "2s", value_parser = parse_duration)]
    pub clock_skew: Duration,
    /// A job still running after this long is entered in the index of
    /// active jobs and its work ticket settled; until then the ticket (held,
    /// coming back one session timeout after the claim) covers it.
    #[arg(long, env = "LH_INDEX_AFTER", default_value = "1s", value_parser = parse_duration)]
    pub index_after: Duration,
    /// At SIGTERM/SIGINT, how long in-flight jobs may run on before they are handed back.
    #[arg(long, env = "LH_DRAIN_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub drain_timeout: Duration,
    /// After the drain, how long handing the remaining jobs back (and
    /// ending the session) may take. Then the process exits whatever NATS
    /// does, non-zero if a job was not handed back (its session's end, or
    /// its TTL, recovers it). A stop takes at most drain timeout +
    /// hand-back timeout + 1s.
    #[arg(long, env = "LH_HAND_BACK_TIMEOUT", default_value = "15s", value_parser = parse_duration)]
    pub hand_back_timeout: Duration,
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
    /// The share of each provider limit this worker uses alone when its
    /// quota lease could not be renewed (NATS away), 0 < F <= 1. Default:
    /// the limit divided by the workers it last knew of.
    #[arg(long, env = "LH_FLOW_LOCAL_SHARE", value_parser = parse_share)]
    pub flow_local_share: Option<f64>,
    /// A job whose workers already stopped this many times while running it
    /// is dead-lettered as poison instead of being re-offered again.
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
    /// Serve /healthz, /readyz and /metrics on this address (e.g.
    /// `0.0.0.0:9090`). No HTTP server when unset.
    #[arg(long, env = "LH_HTTP_LISTEN")]
    pub http_listen: Option<std::net::SocketAddr>,
    /// Instead of serving: replay the recorded journals of KIND's active
    /// jobs (running, queued, waiting, parked) against this build (its
    /// code, or its `--remote-kind` service), writing nothing, print one
    /// JSON line per job (`matches`, with the step it runs next, or
    /// `mismatch` with why: it would park with `journal_mismatch`), and
    /// exit: 0 every journal matches, 1 one does not (or its replay
    /// failed), 2 bad usage. Run it before rolling out changed code.
    #[arg(long, env = "LH_JOURNAL_CHECK", value_name = "KIND")]
    pub journal_check: Option<String>,
    /// Kinds served by an HTTP service through the worker protocol
    /// (docs/protocol.md): `NAME=URL`, repeated or comma-separated
    /// (`--remote-kind invoice=http://127.0.0.1:9000/`). They are served
    /// beside `--kinds`. The service's bearer token and signing secret are
    /// read from `LH_REMOTE_TOKEN` and `LH_REMOTE_HMAC_SECRET` only, or
    /// from the variables a kind names (`NAME=URL;token=VAR;secret=VAR`).
    #[arg(long = "remote-kind", env = "LH_REMOTE_KINDS", value_delimiter = ',')]
    pub remote_kinds: Vec<String>,
    /// The longest one call to a remote kind's service may take.
    #[arg(long, env = "LH_REMOTE_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub remote_timeout: Duration,
    /// Journal entries sent to a remote kind's service in one call at most
    /// (more are paged).
    #[arg(long, env = "LH_REMOTE_JOURNAL_PAGE", default_value_t = 256)]
    pub remote_journal_page: usize,
    /// The largest request or answer body of the worker protocol, in bytes.
    #[arg(long, env = "LH_REMOTE_MAX_BODY", default_value_t = 1 << 20)]
    pub remote_max_body: usize,
}

fn parse_share(v: &str) -> Result<f64, String> {
    match v.trim().parse::<f64>() {
        Ok(f) if f > 0.0 && f <= 1.0 => Ok(f),
        _ => Err(format!(
            "{v:?}: expected a fraction above 0 and at most 1, e.g. 0.25"
        )),
    }
}

/// How long after `--index-after` a held ticket may come back at the
/// earliest: the index write's own time.
const INDEX_MARGIN: Duration = Duration::from_secs(2);

/// See [`Options::ticket_return`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TicketReturn {
    /// After the claim, when the held ticket comes back by itself.
    pub after: Duration,
    /// Whether the claim NAKs the ticket with that delay.
    pub set_wake_up: bool,
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

    /// The session renewal interval.
    pub fn renew_every(&self) -> Duration {
        self.session_renew.unwrap_or(self.session_timeout / 5)
    }

    /// The longest a stop (SIGTERM/SIGINT) takes before the process exits:
    /// the drain, the hand-back, and a second for the exit.
    pub fn stop_bound(&self) -> Duration {
        self.drain_timeout + self.hand_back_timeout + Duration::from_secs(1)
    }

    /// When a held ticket comes back if its job is neither finished nor
    /// indexed: one session timeout after the claim, and never before the
    /// job had its chance to be indexed.
    pub fn wake_after(&self) -> Duration {
        self.session_timeout.max(self.index_after + INDEX_MARGIN)
    }

    /// When a claimed job's held ticket comes back by itself if the job is
    /// neither finished nor indexed by then, and whether its claim sets a
    /// wake-up for that (a NAK delayed by [`Options::wake_after`]). Not when
    /// the kind's consumer redelivers it on its own (`ack_wait`: its first
    /// redelivery) after the job had its chance to be indexed and no later
    /// than the wake-up would: then the wake-up is one message per job for
    /// nothing (the defaults: 10s and 10s). `None`: the ack wait is not
    /// known (yet), so the wake-up is set.
    pub fn ticket_return(&self, ack_wait: Option<Duration>) -> TicketReturn {
        match ack_wait {
            Some(w) if self.index_after + INDEX_MARGIN <= w && w <= self.wake_after() => {
                TicketReturn {
                    after: w,
                    set_wake_up: false,
                }
            }
            _ => TicketReturn {
                after: self.wake_after(),
                set_wake_up: true,
            },
        }
    }

    /// Rejects contradictory settings with a message saying what to change.
    pub fn validate(&self) -> Result<(), String> {
        let fmt = leasehold_core::time::format_duration;
        if self.concurrency == 0 {
            return Err("--concurrency must be at least 1".into());
        }
        if self.session_timeout < Duration::from_secs(1) {
            return Err(format!(
                "--session-timeout ({}) must be at least 1s (the server's TTL resolution)",
                fmt(self.session_timeout)
            ));
        }
        let renew = self.renew_every();
        if renew.is_zero() || renew * 2 > self.session_timeout {
            return Err(format!(
                "--session-renew ({}) must be at most half of --session-timeout ({}); a fifth is the default",
                fmt(renew),
                fmt(self.session_timeout)
            ));
        }
        if self.attempt_timeout < Duration::from_secs(1) {
            return Err("--attempt-timeout must be at least 1s".into());
        }
        if let Some(id) = &self.worker_id {
            if !leasehold_store::layout::valid_worker_id(id) {
                return Err(format!(
                    "--worker-id {id:?}: use 1-128 letters, digits, '-', '_' or '=' (it names a KV key and a subject token)"
                ));
            }
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

    /// Variables of an older release that no longer mean anything, with
    /// what replaced them (named at start so a stale deployment is noticed).
    pub fn retired_variables() -> Vec<(&'static str, &'static str)> {
        [
            ("LH_LEASE", "liveness is per process now: --session-timeout (LH_SESSION_TIMEOUT); the longest attempt is --attempt-timeout"),
            ("LH_HEARTBEAT", "sessions are renewed every --session-renew (LH_SESSION_RENEW)"),
        ]
        .into_iter()
        .filter(|(k, _)| std::env::var_os(k).is_some())
        .collect()
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

    #[test]
    fn a_claim_sets_a_wake_up_only_when_the_ack_wait_would_not_do() {
        let o = Options::parse_from(["leasehold-worker"]);
        let s = Duration::from_secs;
        // The defaults (10s session, 1s --index-after, 10s ack wait): the
        // consumer's own redelivery is the wake-up.
        assert_eq!(
            o.ticket_return(Some(s(10))),
            TicketReturn {
                after: s(10),
                set_wake_up: false
            }
        );
        assert_eq!(
            o.ticket_return(Some(s(3))),
            TicketReturn {
                after: s(3),
                set_wake_up: false
            }
        );
        // Later than the session timeout, too early to index, or unknown.
        for w in [Some(s(30)), Some(Duration::from_millis(2500)), None] {
            assert_eq!(
                o.ticket_return(w),
                TicketReturn {
                    after: s(10),
                    set_wake_up: true
                },
                "{w:?}"
            );
        }
        // A short session (the soak's 3s): the wake-up comes first.
        let o = Options::parse_from(["leasehold-worker", "--session-timeout", "3s"]);
        assert!(o.ticket_return(Some(s(10))).set_wake_up);
        assert!(!o.ticket_return(Some(s(3))).set_wake_up);
    }
}
