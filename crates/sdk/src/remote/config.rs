//! How a worker reaches a remote kind's service ([`RemoteConfig`]): its URL,
//! credentials and bounds, read from the worker's options.

use std::time::Duration;

#[cfg(doc)]
use super::signature;

/// How a worker reaches a remote kind's service.
///
/// ```
/// let cfg = leasehold::RemoteConfig::new("http://127.0.0.1:9000/").bearer("s3cret");
/// assert_eq!(cfg.url, "http://127.0.0.1:9000");
/// ```
#[derive(Clone)]
pub struct RemoteConfig {
    /// The service's base URL (no trailing slash): `POST {url}/invoke`,
    /// `POST {url}/tools/{name}`, `POST {url}/tools/{name}/find_existing`.
    pub url: String,
    /// Sent as `Authorization: Bearer <token>` with every request.
    pub token: Option<String>,
    /// Signs every request (`X-Leasehold-Signature: t=<unix>,n=<nonce>,v2=<hex>`,
    /// HMAC-SHA256 of `<t>.<nonce>.POST.<path>.<body>`: see [`signature`]).
    pub hmac_secret: Option<String>,
    /// The longest one call may take.
    pub timeout: Duration,
    /// Journal entries per call at most.
    pub page: usize,
    /// The largest request or answer body, in bytes.
    pub max_body: usize,
}

impl std::fmt::Debug for RemoteConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemoteConfig")
            .field("url", &self.url)
            .field("token", &self.token.as_ref().map(|_| "<set>"))
            .field("hmac_secret", &self.hmac_secret.as_ref().map(|_| "<set>"))
            .field("timeout", &self.timeout)
            .field("page", &self.page)
            .field("max_body", &self.max_body)
            .finish()
    }
}

impl RemoteConfig {
    /// A service at `url`, with the defaults (30 s per call, 256 journal
    /// entries per page, 1 MiB bodies) and no authentication.
    pub fn new(url: &str) -> RemoteConfig {
        RemoteConfig {
            url: url.trim_end_matches('/').to_string(),
            token: None,
            hmac_secret: None,
            timeout: Duration::from_secs(30),
            page: 256,
            max_body: 1 << 20,
        }
    }

    /// With a bearer token.
    pub fn bearer(mut self, token: &str) -> RemoteConfig {
        self.token = Some(token.to_string());
        self
    }

    /// With an HMAC-SHA256 signing secret.
    pub fn hmac(mut self, secret: &str) -> RemoteConfig {
        self.hmac_secret = Some(secret.to_string());
        self
    }

    /// The remote kinds of a worker's options (`--remote-kind NAME=URL`),
    /// with `LH_REMOTE_TOKEN` and `LH_REMOTE_HMAC_SECRET` from the
    /// environment, or the variables a kind names for itself
    /// (`NAME=URL;token=VAR;secret=VAR`).
    pub fn from_options(opts: &crate::Options) -> Result<Vec<(String, RemoteConfig)>, String> {
        Self::from_options_with(opts, |k| std::env::var(k).ok())
    }

    /// [`RemoteConfig::from_options`] reading variables with `var`.
    ///
    /// A kind's spec is `NAME=URL`, optionally followed by `;token=VAR`
    /// and `;secret=VAR`: the names of the environment variables holding
    /// that kind's bearer token and signing secret (the values are never
    /// on the command line). A kind that names none uses
    /// `LH_REMOTE_TOKEN` / `LH_REMOTE_HMAC_SECRET`; a named variable that
    /// is unset or empty is an error, not a kind served without it.
    ///
    /// ```
    /// let mut o = leasehold::Options::local("nats://127.0.0.1:4222", "lh");
    /// o.remote_kinds = vec!["invoice=http://a:9000/;secret=INVOICE_SECRET".into()];
    /// let kinds = leasehold::RemoteConfig::from_options_with(&o, |k| {
    ///     (k == "INVOICE_SECRET").then(|| "s3cret".to_string())
    /// })
    /// .unwrap();
    /// assert_eq!(kinds[0].1.hmac_secret.as_deref(), Some("s3cret"));
    /// ```
    pub fn from_options_with(
        opts: &crate::Options,
        var: impl Fn(&str) -> Option<String>,
    ) -> Result<Vec<(String, RemoteConfig)>, String> {
        let read = |k: &str| var(k).filter(|s| !s.is_empty());
        let token = read("LH_REMOTE_TOKEN");
        let secret = read("LH_REMOTE_HMAC_SECRET");
        let mut out = Vec::new();
        for spec in opts.remote_kinds.iter().filter(|s| !s.trim().is_empty()) {
            let (name, rest) = spec.split_once('=').ok_or_else(|| {
                format!("--remote-kind {spec:?}: expected NAME=URL, e.g. invoice=http://127.0.0.1:9000/")
            })?;
            let mut parts = rest.split(';');
            let (name, url) = (name.trim(), parts.next().unwrap_or("").trim());
            if name.is_empty() || !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(format!(
                    "--remote-kind {spec:?}: expected NAME=URL with an http(s) URL"
                ));
            }
            if opts.remote_journal_page == 0 {
                return Err("--remote-journal-page must be at least 1".into());
            }
            let mut cfg = RemoteConfig::new(url);
            cfg.token = token.clone();
            cfg.hmac_secret = secret.clone();
            for part in parts.map(str::trim).filter(|p| !p.is_empty()) {
                let (key, name_of_var) = part.split_once('=').unwrap_or((part, ""));
                let valid = !name_of_var.is_empty()
                    && name_of_var
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_');
                if !valid {
                    return Err(format!(
                        "--remote-kind {name}: `{part}` is not `token=VAR` or `secret=VAR` (VAR: the name of an environment variable)"
                    ));
                }
                let value = || {
                    read(name_of_var).ok_or_else(|| {
                        format!("--remote-kind {name}: {key}={name_of_var}, but {name_of_var} is not set (or empty)")
                    })
                };
                match key {
                    "token" => cfg.token = Some(value()?),
                    "secret" => cfg.hmac_secret = Some(value()?),
                    other => {
                        return Err(format!(
                        "--remote-kind {name}: unknown setting `{other}` (token=VAR, secret=VAR)"
                    ))
                    }
                }
            }
            cfg.timeout = opts.remote_timeout;
            cfg.page = opts.remote_journal_page;
            cfg.max_body = opts.remote_max_body;
            out.push((name.to_string(), cfg));
        }
        Ok(out)
    }
}
