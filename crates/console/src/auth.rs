//! Who is calling, and whether they may act.
//!
//! Off only on loopback (no token, no trusted header: every caller is
//! `local` and may act). Otherwise a bearer token (`Authorization: Bearer`,
//! or the cookie the login form sets) or a header set by an authenticating
//! proxy; read-only unless the token is the operator token or the proxy's
//! user is listed in `--operators`.
//!
//! CSRF: a cookie, a proxy's session or no auth at all ride along with any
//! request a browser sends, so every action (a POST) of such a caller must
//! carry the form field `csrf`, a digest of the caller's name and a secret
//! drawn at start, which only pages of this console render; and a request
//! whose `Origin` is not this console's host is refused. A bearer token in
//! a header is never sent by a browser on its own.

use std::sync::Arc;

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use sha2::{Digest, Sha256};

use crate::app::App;
use crate::Args;

/// The cookie the login form sets (the token, HttpOnly, SameSite=Strict).
pub const COOKIE: &str = "lh_console";

/// Whether auth is off: no token and no trusted header configured (then
/// only on a loopback address, and only for requests naming a loopback
/// host).
pub fn auth_off(a: &Args) -> bool {
    a.read_token.is_none() && a.operator_token.is_none() && a.trusted_header.is_none()
}

/// Whether a `Host` header names this machine's loopback interface
/// (`localhost`, `127.x.y.z` or `[::1]`, with or without a port).
pub fn loopback_host(host: &str) -> bool {
    let name = match host.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(""),
        None => host.rsplit_once(':').map_or(host, |(h, _)| h),
    };
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Why a request may not be served at all, if it may not: with auth off,
/// one whose `Host` is not a loopback name came through a name that
/// resolves here (DNS rebinding: a hostile page's script at
/// `evil.test:PORT` reaching this console), so it is refused (403), reads
/// included.
pub fn host_refused(a: &Args, host: Option<&str>) -> Option<String> {
    if !auth_off(a) || host.is_some_and(loopback_host) {
        return None;
    }
    Some(format!(
        "Host {:?} is not a loopback name: auth is off, so this console answers only requests to localhost, 127.0.0.1 or [::1]; configure --token, --operator-token or --trusted-header to serve other names",
        host.unwrap_or("")
    ))
}

/// A configuration that would leave a non-loopback console open: refused.
pub fn check_config(a: &Args) -> Result<(), String> {
    if auth_off(a) && !a.http_listen.ip().is_loopback() {
        return Err(format!(
            "--http-listen {} is not a loopback address, and no --token, --operator-token or --trusted-header is set: auth is off only on loopback",
            a.http_listen
        ));
    }
    for (flag, t) in [
        ("--token", &a.read_token),
        ("--operator-token", &a.operator_token),
    ] {
        if t.as_ref().is_some_and(|t| t.len() < 16) {
            return Err(format!("{flag} must be at least 16 characters"));
        }
    }
    if !a.operators.is_empty() && a.trusted_header.is_none() {
        return Err("--operators names users of --trusted-header, which is not set".into());
    }
    Ok(())
}

/// How a caller proved who they are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// Auth is off (loopback).
    Local,
    /// `Authorization: Bearer` (not sent by a browser on its own: no CSRF).
    Bearer,
    /// The login form's cookie.
    Cookie,
    /// The trusted proxy header.
    Proxy,
}

/// The caller of a request.
#[derive(Debug, Clone)]
pub struct Caller {
    pub name: String,
    pub can_act: bool,
    pub via: Via,
    /// The address the request came from (what a caller is without auth).
    pub peer: Option<std::net::IpAddr>,
}

impl Caller {
    /// Whether an action must carry the CSRF field.
    pub fn needs_csrf(&self) -> bool {
        self.via != Via::Bearer
    }
}

/// Equal in constant time (for tokens).
pub fn same(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// A refused request: 401 for an API, the login page for a page.
pub struct Refused {
    api: bool,
    why: &'static str,
}

impl IntoResponse for Refused {
    fn into_response(self) -> Response {
        if self.api {
            let body = serde_json::json!({"error": self.why}).to_string();
            (
                StatusCode::UNAUTHORIZED,
                [
                    (header::CONTENT_TYPE, "application/json"),
                    (header::WWW_AUTHENTICATE, "Bearer"),
                ],
                body,
            )
                .into_response()
        } else {
            Redirect::to("/login").into_response()
        }
    }
}

impl App {
    /// Who `parts` comes from, by the configured means.
    pub fn caller(&self, parts: &Parts) -> Option<Caller> {
        let a = &self.args;
        if auth_off(a) {
            return Some(Caller {
                name: "local".into(),
                can_act: true,
                via: Via::Local,
                peer: None,
            });
        }
        let bearer = parts
            .headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(|t| (t.trim().to_string(), Via::Bearer));
        let cookie = || {
            parts
                .headers
                .get_all(header::COOKIE)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .flat_map(|v| v.split(';'))
                .find_map(|c| {
                    c.trim()
                        .strip_prefix(&format!("{COOKIE}="))
                        .map(str::to_string)
                })
                .map(|t| (t, Via::Cookie))
        };
        if let Some((t, via)) = bearer.or_else(cookie) {
            if a.operator_token.as_ref().is_some_and(|o| same(o, &t)) {
                return Some(Caller {
                    name: "operator-token".into(),
                    can_act: true,
                    via,
                    peer: None,
                });
            }
            if a.read_token.as_ref().is_some_and(|r| same(r, &t)) {
                return Some(Caller {
                    name: "token".into(),
                    can_act: false,
                    via,
                    peer: None,
                });
            }
        }
        let h = a.trusted_header.as_ref()?;
        let user = parts.headers.get(h.as_str())?.to_str().ok()?.trim();
        if user.is_empty() {
            return None;
        }
        Some(Caller {
            name: user.to_string(),
            can_act: a.operators.iter().any(|o| o == "*" || o == user),
            via: Via::Proxy,
            peer: None,
        })
    }

    /// The CSRF field's value for `caller`.
    pub fn csrf(&self, caller: &Caller) -> String {
        let mut h = Sha256::new();
        h.update(self.secret.as_bytes());
        h.update(b"\0");
        h.update(caller.name.as_bytes());
        hex::encode(h.finalize())
    }

    /// Whether an action's `csrf` field and `Origin` header are this
    /// console's own.
    pub fn csrf_ok(
        &self,
        caller: &Caller,
        parts_origin: Option<&str>,
        host: Option<&str>,
        field: &str,
    ) -> bool {
        if !caller.needs_csrf() {
            return true;
        }
        if let Some(origin) = parts_origin {
            let host_of = origin.split("://").nth(1).unwrap_or("");
            if Some(host_of) != host {
                return false;
            }
        }
        same(&self.csrf(caller), field)
    }
}

impl FromRequestParts<Arc<App>> for Caller {
    type Rejection = Refused;

    async fn from_request_parts(
        parts: &mut Parts,
        app: &Arc<App>,
    ) -> Result<Self, Self::Rejection> {
        let api = parts.uri.path().starts_with("/v1/");
        let peer = parts
            .extensions
            .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
            .map(|c| c.0.ip());
        let mut caller = app.caller(parts).ok_or(Refused {
            api,
            why: "unauthorized: send Authorization: Bearer TOKEN",
        })?;
        caller.peer = peer;
        Ok(caller)
    }
}

#[cfg(test)]
mod tests {
    use super::loopback_host;

    #[test]
    fn loopback_hosts_are_the_loopback_names_only() {
        for h in [
            "localhost",
            "localhost:8090",
            "LOCALHOST:1",
            "127.0.0.1",
            "127.0.0.1:8090",
            "127.1.2.3:80",
            "[::1]",
            "[::1]:8090",
        ] {
            assert!(loopback_host(h), "{h}");
        }
        for h in [
            "evil.test:8090",
            "evil.test",
            "localhost.evil.test:8090",
            "127.0.0.1.evil.test",
            "10.0.0.1:8090",
            "[::2]:8090",
            "",
        ] {
            assert!(!loopback_host(h), "{h}");
        }
    }
}
