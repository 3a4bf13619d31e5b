//! `fetch`: HTTP GET of a web page, as text, with size and time limits.
//!
//! Every hop (the first URL and each redirect, followed here by hand) is
//! checked before any connection: the scheme must be http(s); the host is
//! resolved and every address must pass the [`NetGuard`] unless the host
//! name itself is allow-listed; the connection is then pinned to the
//! checked addresses, so a DNS answer that changes between check and
//! connect (rebinding) cannot reach a private address. Proxies from the
//! environment are not used, for the same reason.
//!
//! Bodies over `max_bytes` are cut (`truncated: true`); only text content
//! types are accepted; HTML is turned into plain text.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use reqwest::Url;
use serde_json::{json, Value};

use super::excerpt;
use crate::error::{from_reqwest, ToolError};
use crate::netguard::{AllowList, NetGuard};
use crate::tool::{ExecCtx, Tool, ToolKind, ToolSpec};

/// Configuration of `fetch`.
#[derive(Debug, Clone)]
pub struct FetchConfig {
    /// Hosts and CIDRs allowed although private (`LH_FETCH_ALLOW`).
    pub allow: AllowList,
    /// Bytes of body read at most (`LH_FETCH_MAX_BYTES`, default 1 MiB).
    pub max_bytes: usize,
    /// Time limit of the whole fetch, redirects included (`LH_FETCH_TIMEOUT`, default 15 s).
    pub timeout: Duration,
    /// Redirects followed at most (default 5).
    pub max_redirects: usize,
    /// Characters of text returned at most (default 50,000).
    pub max_text_chars: usize,
}

impl Default for FetchConfig {
    fn default() -> Self {
        FetchConfig {
            allow: AllowList::default(),
            max_bytes: 1024 * 1024,
            timeout: Duration::from_secs(15),
            max_redirects: 5,
            max_text_chars: 50_000,
        }
    }
}

/// The `fetch` tool.
pub struct FetchTool {
    config: FetchConfig,
    guard: NetGuard,
    spec: ToolSpec,
}

/// Where one hop may connect.
enum Target {
    /// The host name is allow-listed: normal resolution.
    Allowed,
    /// Connect only to these checked addresses.
    Pinned(String, Vec<SocketAddr>),
}

impl FetchTool {
    pub fn new(config: FetchConfig) -> Self {
        let guard = NetGuard::new(config.allow.clone());
        let spec = ToolSpec {
            name: "fetch".into(),
            description: "Fetch a web page (http or https) and return its text.".into(),
            kind: ToolKind::Read,
            schema: json!({
                "type": "object",
                "properties": {
                    "url": {"type": "string", "pattern": "^[hH][tT][tT][pP][sS]?://", "maxLength": 2048}
                },
                "required": ["url"],
                "additionalProperties": false
            }),
            // The toolbox's bound sits a little above the fetch's own
            // deadline so the fetch reports which limit it hit.
            timeout: config.timeout + Duration::from_secs(1),
        };
        FetchTool {
            config,
            guard,
            spec,
        }
    }

    /// Checks one hop's destination; `Refused` says why not.
    async fn check(&self, url: &Url, remaining: Duration) -> Result<Target, ToolError> {
        match url.scheme() {
            "http" | "https" => {}
            s => {
                return Err(ToolError::Refused(format!(
                    "scheme `{s}` is not http or https"
                )))
            }
        }
        let port = url
            .port_or_known_default()
            .ok_or_else(|| ToolError::Refused(format!("{url} has no port")))?;
        match url.host() {
            None => Err(ToolError::Refused(format!("{url} has no host"))),
            Some(url::Host::Ipv4(ip)) => {
                self.check_ip(IpAddr::V4(ip), url).map(|_| Target::Allowed)
            }
            Some(url::Host::Ipv6(ip)) => {
                self.check_ip(IpAddr::V6(ip), url).map(|_| Target::Allowed)
            }
            Some(url::Host::Domain(name)) => {
                if self.guard.host_allowed(name) {
                    return Ok(Target::Allowed);
                }
                let addrs: Vec<SocketAddr> =
                    tokio::time::timeout(remaining, tokio::net::lookup_host((name, port)))
                        .await
                        .map_err(|_| ToolError::Timeout(self.config.timeout))?
                        .map_err(|e| ToolError::Transport(format!("cannot resolve {name}: {e}")))?
                        .collect();
                if addrs.is_empty() {
                    return Err(ToolError::Transport(format!(
                        "{name} resolves to no address"
                    )));
                }
                // Every address must pass: a name with one public and one
                // private address is refused, since either could be used.
                for a in &addrs {
                    self.guard.check_ip(a.ip()).map_err(|why| {
                        ToolError::Refused(format!("{name} resolves to {why}; not fetched"))
                    })?;
                }
                Ok(Target::Pinned(name.to_string(), addrs))
            }
        }
    }

    fn check_ip(&self, ip: IpAddr, url: &Url) -> Result<(), ToolError> {
        self.guard
            .check_ip(ip)
            .map_err(|why| ToolError::Refused(format!("{url}: {why}; not fetched")))
    }

    async fn run(&self, args: &Value) -> Result<Value, ToolError> {
        let raw = args["url"].as_str().unwrap_or_default();
        let mut url = Url::parse(raw).map_err(|e| ToolError::InvalidArgs {
            tool: "fetch".into(),
            message: format!("`{raw}` is not a URL: {e}"),
        })?;
        let deadline = Instant::now() + self.config.timeout;
        let mut redirects = 0;
        loop {
            let remaining = deadline
                .checked_duration_since(Instant::now())
                .filter(|d| !d.is_zero())
                .ok_or(ToolError::Timeout(self.config.timeout))?;
            let target = self.check(&url, remaining).await?;
            let mut builder = reqwest::Client::builder()
                .redirect(reqwest::redirect::Policy::none())
                .no_proxy()
                .timeout(remaining)
                .user_agent(concat!("leasehold-fetch/", env!("CARGO_PKG_VERSION")));
            if let Target::Pinned(host, addrs) = &target {
                builder = builder.resolve_to_addrs(host, addrs);
            }
            let client = builder
                .build()
                .map_err(|e| ToolError::Config(format!("fetch client: {e}")))?;
            let resp = client
                .get(url.clone())
                .header(
                    "Accept",
                    "text/html, text/plain;q=0.9, application/json;q=0.8, */*;q=0.1",
                )
                .send()
                .await
                .map_err(|e| from_reqwest(e, self.config.timeout))?;
            let status = resp.status();
            if status.is_redirection() {
                let Some(loc) = resp.headers().get(reqwest::header::LOCATION) else {
                    return Err(ToolError::BadResponse(format!(
                        "{url}: HTTP {status} without Location"
                    )));
                };
                let loc = loc.to_str().map_err(|_| {
                    ToolError::BadResponse(format!("{url}: unreadable Location header"))
                })?;
                let next = url.join(loc).map_err(|e| {
                    ToolError::BadResponse(format!("{url}: bad redirect `{loc}`: {e}"))
                })?;
                redirects += 1;
                if redirects > self.config.max_redirects {
                    return Err(ToolError::BadResponse(format!(
                        "more than {} redirects",
                        self.config.max_redirects
                    )));
                }
                url = next;
                continue;
            }
            if !status.is_success() {
                let body = resp.text().await.unwrap_or_default();
                return Err(ToolError::Upstream {
                    status: status.as_u16(),
                    message: excerpt(&body),
                });
            }
            return self.read_page(url, status.as_u16(), resp, redirects).await;
        }
    }

    async fn read_page(
        &self,
        url: Url,
        status: u16,
        mut resp: reqwest::Response,
        redirects: usize,
    ) -> Result<Value, ToolError> {
        let content_type = resp
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_ascii_lowercase();
        let mime = content_type
            .split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_string();
        let is_html = mime == "text/html" || mime == "application/xhtml+xml";
        let is_text = is_html
            || mime.starts_with("text/")
            || mime == "application/json"
            || mime.ends_with("+json")
            || mime == "application/xml";
        if !is_text {
            return Err(ToolError::BadResponse(format!(
                "{url}: content type `{}` is not text; not read",
                if mime.is_empty() { "(none)" } else { &mime }
            )));
        }
        let mut body: Vec<u8> = Vec::new();
        let mut truncated = false;
        while let Some(chunk) = resp
            .chunk()
            .await
            .map_err(|e| from_reqwest(e, self.config.timeout))?
        {
            let room = self.config.max_bytes - body.len();
            if chunk.len() > room {
                body.extend_from_slice(&chunk[..room]);
                truncated = true;
                // Stop reading: the rest is never downloaded.
                break;
            }
            body.extend_from_slice(&chunk);
        }
        let links = if is_html {
            html_links(&body, &url)
        } else {
            Vec::new()
        };
        let (title, mut text) = if is_html {
            let title = html_title(&body);
            let text = html2text::from_read(&body[..], 100)
                .unwrap_or_else(|_| String::from_utf8_lossy(&body).into_owned());
            (title, text)
        } else {
            (None, String::from_utf8_lossy(&body).into_owned())
        };
        if let Some((i, _)) = text.char_indices().nth(self.config.max_text_chars) {
            text.truncate(i);
            truncated = true;
        }
        Ok(json!({
            "url": url.as_str(),
            "status": status,
            "content_type": mime,
            "title": title,
            "text": text,
            "links": links,
            "bytes": body.len(),
            "truncated": truncated,
            "redirects": redirects,
        }))
    }
}

/// The text of the first `<title>` element, if any.
fn html_title(body: &[u8]) -> Option<String> {
    let s = String::from_utf8_lossy(body);
    let lower = s.to_ascii_lowercase();
    let start = lower.find("<title")?;
    let open_end = start + lower[start..].find('>')? + 1;
    let close = open_end + lower[open_end..].find("</title")?;
    let t = s[open_end..close]
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    (!t.is_empty()).then_some(t)
}

/// Up to 50 distinct absolute http(s) links of a page, resolved against its
/// URL, so the model can fetch them without guessing the base.
fn html_links(body: &[u8], base: &Url) -> Vec<String> {
    let s = String::from_utf8_lossy(body);
    let lower = s.to_ascii_lowercase();
    let mut out: Vec<String> = Vec::new();
    let mut from = 0;
    while let Some(pos) = lower[from..].find("href=") {
        let start = from + pos + "href=".len();
        from = start;
        let rest = &s[start..];
        let (quote, rest) = match rest.chars().next() {
            Some(q @ ('"' | '\'')) => (Some(q), &rest[1..]),
            _ => (None, rest),
        };
        let end = match quote {
            Some(q) => rest.find(q),
            None => rest.find(|c: char| c.is_whitespace() || c == '>'),
        };
        let Some(end) = end else { break };
        if let Ok(u) = base.join(rest[..end].trim()) {
            if matches!(u.scheme(), "http" | "https") {
                let u = u.to_string();
                if !out.contains(&u) {
                    out.push(u);
                }
            }
        }
        if out.len() >= 50 {
            break;
        }
    }
    out
}

impl Tool for FetchTool {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    fn endpoint(&self) -> String {
        if self.config.allow.is_empty() {
            "any public http(s) URL".into()
        } else {
            format!(
                "any public http(s) URL; allowed private: {}",
                self.config.allow.display()
            )
        }
    }

    fn execute<'a>(
        &'a self,
        args: &'a Value,
        _ctx: &'a ExecCtx,
    ) -> BoxFuture<'a, Result<Value, ToolError>> {
        Box::pin(self.run(args))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn title_is_found_case_insensitively() {
        assert_eq!(
            html_title(b"<html><TITLE> A  b </TITLE>").as_deref(),
            Some("A b")
        );
        assert_eq!(html_title(b"<p>none</p>"), None);
    }

    #[test]
    fn links_are_absolute_and_distinct() {
        let base = Url::parse("http://h:1/page/a").unwrap();
        let body = br#"<a href="/page/b">b</a> <A HREF='c'>c</A> <a href=/page/b>b</a> <a href="mailto:x@y">m</a>"#;
        assert_eq!(
            html_links(body, &base),
            vec!["http://h:1/page/b", "http://h:1/page/c"]
        );
    }
}
