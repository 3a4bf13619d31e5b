//! Connecting to NATS the same way in every binary.
//!
//! Variables (each also a flag): `NATS_URL` (default `nats://127.0.0.1:4222`),
//! `NATS_CREDS` (creds file), `NATS_USER` + `NATS_PASSWORD`, `NATS_TOKEN`,
//! `NATS_CA`, `NATS_CERT` + `NATS_KEY` (TLS), and `LH_PREFIX` (namespace,
//! default `lh`).

use std::path::PathBuf;
use std::time::Duration;

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

    /// Connects and returns the client together with the namespace layout.
    pub async fn connect(&self, name: &str) -> Result<Conn, StoreError> {
        let layout = Layout::new(&self.prefix)?;
        let mut opts = async_nats::ConnectOptions::new()
            .name(name)
            .connection_timeout(Duration::from_secs(5));
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
            .map_err(|e| StoreError::Config(format!("NATS_URL {:?}: {e}", self.url)))?;
        // Fail fast with a clear message when nothing answers, instead of the
        // client's silent retry loop.
        let client = tokio::time::timeout(Duration::from_secs(10), opts.connect(addrs))
            .await
            .map_err(|_| {
                StoreError::Connect(format!(
                    "no NATS server answered at {} within 10s (set NATS_URL, or start one: `nats-server -js`)",
                    self.url
                ))
            })?
            .map_err(|e| StoreError::Connect(format!("{}: {e}; set NATS_URL to a running server (`nats-server -js`)", self.url)))?;
        Ok(Conn::new(client, layout))
    }
}

/// A connected client plus the namespace it works in.
#[derive(Clone)]
pub struct Conn {
    pub client: async_nats::Client,
    pub js: async_nats::jetstream::Context,
    pub layout: Layout,
}

impl Conn {
    pub fn new(client: async_nats::Client, layout: Layout) -> Self {
        let js = async_nats::jetstream::new(client.clone());
        Conn { client, js, layout }
    }
}
