//! Connecting to NATS the same way in every binary.
//!
//! Variables (each also a flag): `NATS_URL` (default `nats://127.0.0.1:4222`),
//! `NATS_CREDS` (creds file), `NATS_USER` + `NATS_PASSWORD`, `NATS_TOKEN`,
//! `NATS_CA`, `NATS_CERT` + `NATS_KEY` (TLS), `LH_PREFIX` (namespace,
//! default `lh`) and `LH_INBOX_PREFIX` (the subject prefix of reply inboxes,
//! default `_INBOX`; a user whose permissions allow subscribing only to
//! `_INBOX_<role>.>` sets it to `_INBOX_<role>`).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::layout::Layout;
use crate::StoreError;

/// How to reach NATS and which namespace to use. Flatten into a clap parser
/// (its options show under their own heading in `--help`).
#[derive(clap::Args, Debug, Clone)]
#[command(next_help_heading = "NATS connection")]
pub struct NatsArgs {
    /// NATS server URL(s), comma-separated.
    #[arg(
        long = "nats-url",
        env = "NATS_URL",
        default_value = "nats://127.0.0.1:4222",
        global = true
    )]
    pub url: String,
    /// NATS credentials file (JWT + nkey seed).
    #[arg(long = "nats-creds", env = "NATS_CREDS", global = true)]
    pub creds: Option<PathBuf>,
    /// NATS user name (with --nats-password).
    #[arg(long = "nats-user", env = "NATS_USER", global = true)]
    pub user: Option<String>,
    /// NATS password (with --nats-user).
    #[arg(
        long = "nats-password",
        env = "NATS_PASSWORD",
        hide_env_values = true,
        global = true
    )]
    pub password: Option<String>,
    /// NATS token.
    #[arg(
        long = "nats-token",
        env = "NATS_TOKEN",
        hide_env_values = true,
        global = true
    )]
    pub token: Option<String>,
    /// CA certificate (PEM) to verify the server's TLS certificate.
    #[arg(long = "nats-ca", env = "NATS_CA", global = true)]
    pub ca: Option<PathBuf>,
    /// Client certificate (PEM) for mutual TLS (with --nats-key).
    #[arg(long = "nats-cert", env = "NATS_CERT", global = true)]
    pub cert: Option<PathBuf>,
    /// Client key (PEM) for mutual TLS (with --nats-cert).
    #[arg(long = "nats-key", env = "NATS_KEY", global = true)]
    pub key: Option<PathBuf>,
    /// Namespace prefix of every subject, stream and bucket (`lh` gives `lh.submit.>`, `lh_jobs`, `LH_WORK`).
    #[arg(
        long = "prefix",
        env = "LH_PREFIX",
        default_value = "lh",
        global = true
    )]
    pub prefix: String,
    /// Subject prefix of this client's reply inboxes (JetStream API replies,
    /// KV and object-store reads, requests). Set it to the prefix your NATS
    /// user may subscribe to (`_INBOX_worker` for `_INBOX_worker.>`).
    #[arg(
        long = "inbox-prefix",
        env = "LH_INBOX_PREFIX",
        default_value = "_INBOX",
        value_parser = parse_inbox_prefix,
        global = true
    )]
    pub inbox_prefix: String,
}

/// An inbox prefix is one or more subject tokens without wildcards.
fn parse_inbox_prefix(s: &str) -> Result<String, String> {
    let ok = !s.is_empty()
        && s.split('.').all(|t| {
            !t.is_empty()
                && t.chars()
                    .all(|c| !c.is_whitespace() && c != '*' && c != '>')
        });
    if ok {
        Ok(s.to_string())
    } else {
        Err(format!(
            "{s:?} is not a subject prefix: use tokens without spaces or wildcards, like _INBOX_worker"
        ))
    }
}

impl Default for NatsArgs {
    fn default() -> Self {
        NatsArgs {
            url: "nats://127.0.0.1:4222".into(),
            creds: None,
            user: None,
            password: None,
            token: None,
            ca: None,
            cert: None,
            key: None,
            prefix: "lh".into(),
            inbox_prefix: "_INBOX".into(),
        }
    }
}

impl NatsArgs {
    /// Arguments for a given URL and prefix, no credentials (tests, demo).
    pub fn local(url: impl Into<String>, prefix: impl Into<String>) -> Self {
        NatsArgs {
            url: url.into(),
            prefix: prefix.into(),
            ..NatsArgs::default()
        }
    }

    /// The server URL(s) with any credentials in them replaced by `***`,
    /// for logs and errors.
    pub fn url_for_logs(&self) -> String {
        redact_url(&self.url)
    }

    /// Connects and returns the client together with the namespace layout.
    pub async fn connect(&self, name: &str) -> Result<Conn, StoreError> {
        let layout = Layout::new(&self.prefix)?;
        let link = Link::default();
        let events = link.clone();
        let mut opts = async_nats::ConnectOptions::new()
            .name(name)
            .custom_inbox_prefix(&self.inbox_prefix)
            .connection_timeout(Duration::from_secs(5))
            .reconnect_delay_callback(reconnect_delay)
            .event_callback(move |ev| {
                let events = events.clone();
                async move { events.on(ev) }
            });
        if let Some(creds) = &self.creds {
            opts = opts
                .credentials_file(creds)
                .await
                .map_err(|e| StoreError::Config(format!("NATS_CREDS {}: {e}", creds.display())))?;
        }
        if let (Some(u), Some(p)) = (&self.user, &self.password) {
            opts = opts.user_and_password(u.clone(), p.clone());
        } else if self.user.is_some() || self.password.is_some() {
            return Err(StoreError::Config(
                "NATS_USER and NATS_PASSWORD must be given together".into(),
            ));
        }
        if let Some(t) = &self.token {
            opts = opts.token(t.clone());
        }
        if let Some(ca) = &self.ca {
            opts = opts.add_root_certificates(ca.clone()).require_tls(true);
        }
        match (&self.cert, &self.key) {
            (Some(c), Some(k)) => {
                opts = opts
                    .add_client_certificate(c.clone(), k.clone())
                    .require_tls(true)
            }
            (None, None) => {}
            _ => {
                return Err(StoreError::Config(
                    "NATS_CERT and NATS_KEY must be given together".into(),
                ))
            }
        }
        // NATS_URL may list several servers, comma-separated (a cluster).
        let addrs = self
            .url
            .split(',')
            .map(|u| u.trim().parse::<async_nats::ServerAddr>())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| StoreError::Config(format!("NATS_URL {:?}: {e}", self.url_for_logs())))?;
        // Fail fast with a clear message when nothing answers, instead of the
        // client's silent retry loop.
        let client = tokio::time::timeout(Duration::from_secs(10), opts.connect(addrs))
            .await
            .map_err(|_| {
                StoreError::Connect(format!(
                    "no NATS server answered at {} within 10s (set NATS_URL, or start one: `nats-server -js`)",
                    self.url_for_logs()
                ))
            })?
            .map_err(|e| StoreError::Connect(format!("{}: {e}; set NATS_URL to a running server (`nats-server -js`)", self.url_for_logs())))?;
        let mut conn = Conn::new(client, layout);
        conn.link = link;
        self.check_inbox(&conn).await?;
        Ok(conn)
    }

    /// Fails at once when the server refuses this user its reply inbox:
    /// every request, JetStream call and KV read would otherwise only time
    /// out. One request (JetStream's account info, answered even without
    /// JetStream) is raced against the refusal; a refused probe subject or
    /// a slow answer tells nothing, and the connection goes on.
    async fn check_inbox(&self, conn: &Conn) -> Result<(), StoreError> {
        let inbox = format!("{}.", self.inbox_prefix);
        let probe = conn.client.request("$JS.API.INFO", "".into());
        tokio::select! {
            why = conn.link.refused(&inbox) => Err(StoreError::Config(format!(
                "NATS refused this user a subscription to its reply inbox ({why}): set \
                 LH_INBOX_PREFIX (--inbox-prefix) to the inbox prefix its permissions allow \
                 (deploy/nats/permissions.conf: _INBOX_<role>)"
            ))),
            _ = conn.link.refused("$JS.API.INFO") => Ok(()),
            _ = tokio::time::timeout(Duration::from_secs(2), probe) => Ok(()),
        }
    }
}

/// The pause before reconnect attempt `attempts`: at once, then 100 ms
/// doubling, capped at [`RECONNECT_DELAY_CAP`]. The client's own default
/// grows to 4 s, so after a long server outage a process could come back
/// up to 4 s after the server did, as long as the settle time every
/// liveness judgement waits after a reconnect
/// ([`crate::liveness::SETTLE_AFTER_RECONNECT`]): a live worker would be
/// judged gone. With this cap every process is back well within it.
pub fn reconnect_delay(attempts: usize) -> Duration {
    if attempts <= 1 {
        return Duration::ZERO;
    }
    let exp = (attempts - 2).min(16) as u32;
    (Duration::from_millis(100) * 2u32.pow(exp)).min(RECONNECT_DELAY_CAP)
}

/// The longest pause between two reconnect attempts.
pub const RECONNECT_DELAY_CAP: Duration = Duration::from_secs(1);

/// What the connection's events tell: whether it is up, since when, and
/// how often it came back (for readiness, and for judging others' sessions
/// only once our own view of the server has settled).
#[derive(Clone, Debug)]
pub struct Link {
    inner: Arc<Mutex<LinkState>>,
    violation: Arc<tokio::sync::Notify>,
    reconnected: Arc<tokio::sync::Notify>,
}

#[derive(Debug)]
struct LinkState {
    connected: bool,
    since: Instant,
    reconnects: u64,
    /// The server's latest permission errors (`Permissions Violation for
    /// Publish to "..."`), newest last, at most [`KEEP_VIOLATIONS`].
    violations: Vec<String>,
}

const KEEP_VIOLATIONS: usize = 32;

impl Default for Link {
    fn default() -> Self {
        Link {
            inner: Arc::new(Mutex::new(LinkState {
                connected: true,
                since: Instant::now(),
                reconnects: 0,
                violations: Vec::new(),
            })),
            violation: Arc::new(tokio::sync::Notify::new()),
            reconnected: Arc::new(tokio::sync::Notify::new()),
        }
    }
}

impl Link {
    fn on(&self, ev: async_nats::Event) {
        let mut s = self.inner.lock().expect("link state");
        match ev {
            async_nats::Event::Connected => {
                let back = !s.connected;
                if back {
                    s.reconnects += 1;
                }
                s.connected = true;
                s.since = Instant::now();
                if back {
                    self.reconnected.notify_waiters();
                }
            }
            async_nats::Event::Disconnected => {
                s.connected = false;
                s.since = Instant::now();
            }
            async_nats::Event::ServerError(async_nats::ServerError::Other(e))
                if is_permission_violation(&e) =>
            {
                // The server answers a refused publish or subscription with
                // this error alone: the request that needed it only times
                // out. Say what was refused, once per refusal.
                tracing::warn!(
                    error = %e,
                    "NATS refused an operation: this NATS user lacks a permission \
                     (deploy/nats/permissions.conf lists each role's; LH_INBOX_PREFIX \
                     must be the inbox prefix the user may subscribe to)"
                );
                if s.violations.len() >= KEEP_VIOLATIONS {
                    s.violations.remove(0);
                }
                s.violations.push(e);
                self.violation.notify_waiters();
            }
            async_nats::Event::ServerError(e) => {
                tracing::warn!(error = %e, "NATS server error");
            }
            _ => {}
        }
    }

    /// The permission errors the server sent this connection (newest last).
    pub fn violations(&self) -> Vec<String> {
        self.inner.lock().expect("link state").violations.clone()
    }

    /// Resolves with the server's permission error once one names a subject
    /// starting with `subject_prefix` (one seen before the call counts).
    /// Race it against an operation that would otherwise only time out.
    pub async fn refused(&self, subject_prefix: &str) -> String {
        let quoted = format!("\"{subject_prefix}");
        loop {
            let notified = self.violation.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(v) = self
                .violations()
                .into_iter()
                .rev()
                .find(|v| v.contains(&quoted))
            {
                return v;
            }
            notified.await;
        }
    }

    /// Resolves the next time the connection comes back after a loss.
    pub async fn reconnected(&self) {
        self.reconnected.notified().await
    }

    /// Whether the client is connected now.
    pub fn is_connected(&self) -> bool {
        self.inner.lock().expect("link state").connected
    }

    /// How long the connection has been up (zero while it is down).
    pub fn connected_for(&self) -> Duration {
        let s = self.inner.lock().expect("link state");
        if s.connected {
            s.since.elapsed()
        } else {
            Duration::ZERO
        }
    }

    /// How many times the connection came back after a loss.
    pub fn reconnects(&self) -> u64 {
        self.inner.lock().expect("link state").reconnects
    }
}

/// Whether a server error is a refused publish or subscription.
pub fn is_permission_violation(e: &str) -> bool {
    e.to_ascii_lowercase().contains("permissions violation")
}

/// `url` (or a comma-separated list of URLs) with the user-info part's
/// secrets replaced: `nats://user:pw@h` → `nats://user:***@h`,
/// `nats://token@h` → `nats://***@h`.
pub fn redact_url(url: &str) -> String {
    url.split(',')
        .map(|u| {
            let u = u.trim();
            let (scheme, rest) = match u.find("://") {
                Some(i) => (&u[..i + 3], &u[i + 3..]),
                None => ("", u),
            };
            let host_end = rest.find(['/', '?']).unwrap_or(rest.len());
            match rest[..host_end].rfind('@') {
                Some(at) => {
                    let info = &rest[..at];
                    let hidden = match info.find(':') {
                        Some(c) => format!("{}:***", &info[..c]),
                        None => "***".to_string(),
                    };
                    format!("{scheme}{hidden}{}", &rest[at..])
                }
                None => u.to_string(),
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::RECONNECT_DELAY_CAP;
    use super::{is_permission_violation, parse_inbox_prefix, reconnect_delay, redact_url};

    #[test]
    fn reconnects_come_well_within_the_settle_time() {
        use std::time::Duration;
        let d: Vec<u128> = (1..=7).map(|a| reconnect_delay(a).as_millis()).collect();
        assert_eq!(d, vec![0, 100, 200, 400, 800, 1000, 1000]);
        assert!(RECONNECT_DELAY_CAP * 2 < crate::liveness::SETTLE_AFTER_RECONNECT);
        assert_eq!(reconnect_delay(usize::MAX), Duration::from_secs(1));
    }

    #[test]
    fn an_inbox_prefix_is_a_subject_prefix_without_wildcards() {
        assert_eq!(parse_inbox_prefix("_INBOX").unwrap(), "_INBOX");
        assert_eq!(
            parse_inbox_prefix("_INBOX_worker").unwrap(),
            "_INBOX_worker"
        );
        assert_eq!(parse_inbox_prefix("_I.worker").unwrap(), "_I.worker");
        for bad in ["", "_INBOX.>", "a.*", "a..b", "a b", ".a", "a."] {
            assert!(parse_inbox_prefix(bad).is_err(), "{bad:?} accepted");
        }
        assert!(is_permission_violation(
            "Permissions Violation for Publish to \"$KV.lh_jobs.x\""
        ));
        assert!(!is_permission_violation("Slow Consumer"));
    }

    #[test]
    fn credentials_never_reach_a_log() {
        assert_eq!(redact_url("nats://a:secret@h:4222"), "nats://a:***@h:4222");
        assert_eq!(redact_url("nats://tok@h"), "nats://***@h");
        assert_eq!(
            redact_url("nats://h1:4222, tls://u:p@h2:4222"),
            "nats://h1:4222,tls://u:***@h2:4222"
        );
        assert_eq!(redact_url("nats://h/path@x"), "nats://h/path@x");
    }
}

/// A connected client plus the namespace it works in.
#[derive(Clone)]
pub struct Conn {
    pub client: async_nats::Client,
    pub js: async_nats::jetstream::Context,
    pub layout: Layout,
    pub link: Link,
    elections: Arc<std::sync::OnceLock<crate::failover::Elections>>,
}

impl Conn {
    pub fn new(client: async_nats::Client, layout: Layout) -> Self {
        let js = async_nats::jetstream::new(client.clone());
        Conn {
            client,
            js,
            layout,
            link: Link::default(),
            elections: Arc::default(),
        }
    }

    /// The leaders' elections and the connection's returns (see
    /// [`crate::failover`]), followed from the first call on.
    pub fn elections(&self) -> crate::failover::Elections {
        if tokio::runtime::Handle::try_current().is_err() {
            // Nothing to follow them with (a client built outside a
            // runtime): requests wait for their own timeouts.
            return crate::failover::Elections::none();
        }
        self.elections
            .get_or_init(|| crate::failover::Elections::follow(self))
            .clone()
    }

    /// How long the connection has been up (see [`Link`]).
    pub fn connected_for(&self) -> Duration {
        self.link.connected_for()
    }
}
