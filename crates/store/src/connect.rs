//! Connecting to NATS the same way in every binary.
//!
//! Variables (each also a flag): `NATS_URL` (default `nats://127.0.0.1:4222`),
//! `NATS_CREDS` (creds file), `NATS_USER` + `NATS_PASSWORD`, `NATS_TOKEN`,
//! `NATS_CA`, `NATS_CERT` + `NATS_KEY` (TLS), and `LH_PREFIX` (namespace,
//! default `lh`).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::layout::Layout;
use crate::StoreError;

/// How to reach NATS and which namespace to use. Flatten into a clap parser.
#[derive(clap::Args, Debug, Clone)]
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
            .connection_timeout(Duration::from_secs(5))
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
        Ok(conn)
    }
}

/// What the connection's events tell: whether it is up, since when, and
/// how often it came back (for readiness, and for judging others' sessions
/// only once our own view of the server has settled).
#[derive(Clone, Debug)]
pub struct Link {
    inner: Arc<Mutex<LinkState>>,
}

#[derive(Debug)]
struct LinkState {
    connected: bool,
    since: Instant,
    reconnects: u64,
}

impl Default for Link {
    fn default() -> Self {
        Link {
            inner: Arc::new(Mutex::new(LinkState {
                connected: true,
                since: Instant::now(),
                reconnects: 0,
            })),
        }
    }
}

impl Link {
    fn on(&self, ev: async_nats::Event) {
        let mut s = self.inner.lock().expect("link state");
        match ev {
            async_nats::Event::Connected => {
                if !s.connected {
                    s.reconnects += 1;
                }
                s.connected = true;
                s.since = Instant::now();
            }
            async_nats::Event::Disconnected => {
                s.connected = false;
                s.since = Instant::now();
            }
            _ => {}
        }
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
    use super::redact_url;

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
}

impl Conn {
    pub fn new(client: async_nats::Client, layout: Layout) -> Self {
        let js = async_nats::jetstream::new(client.clone());
        Conn {
            client,
            js,
            layout,
            link: Link::default(),
        }
    }

    /// How long the connection has been up (see [`Link`]).
    pub fn connected_for(&self) -> Duration {
        self.link.connected_for()
    }
}
