//! Keeping credentials out of logs: [`redact_url`] and [`Secret`].

use std::fmt;

/// What replaces a credential.
pub const MASK: &str = "***";

/// `s` with every credential a URL can carry masked, for logs and errors:
///
/// - the password of `scheme://user:password@host` (`user:***@host`),
/// - a bare token in `scheme://token@host` (`***@host`),
/// - the values of credential-like query parameters (`api_key`, `token`,
///   `access_token`, `password`, `secret`, `sig`, ...): `?api_key=***`.
///
/// Comma-separated lists (`NATS_URL=nats://a:b@h1,nats://c:d@h2`) are
/// redacted element by element, exactly as they are split when connecting.
/// URLs without a scheme (`user:pass@host:4222`) are treated the same way.
/// Anything that is not a URL comes back unchanged.
pub fn redact_url(s: &str) -> String {
    let s = redact_query(s);
    s.split(',')
        .map(redact_userinfo)
        .collect::<Vec<_>>()
        .join(",")
}

/// Free text (an error chain, a log message) with [`redact_url`] applied to
/// every word of it, words being separated by whitespace, quotes, angle
/// brackets and parentheses: `connect to "nats://u:pw@h:4222": refused`
/// becomes `connect to "nats://u:***@h:4222": refused`. An e-mail address
/// looks like `token@host` and is masked too: the safe side.
pub fn redact_text(s: &str) -> String {
    let delimiter =
        |c: char| c.is_whitespace() || matches!(c, '"' | '\'' | '`' | '<' | '>' | '(' | ')');
    let mut out = String::with_capacity(s.len());
    let mut word = String::new();
    let flush = |word: &mut String, out: &mut String| {
        if word.contains(['@', '?', '&']) {
            out.push_str(&redact_url(word));
        } else {
            out.push_str(word);
        }
        word.clear();
    };
    for c in s.chars() {
        if delimiter(c) {
            flush(&mut word, &mut out);
            out.push(c);
        } else {
            word.push(c);
        }
    }
    flush(&mut word, &mut out);
    out
}

/// One element of a list: masks the userinfo of its authority.
fn redact_userinfo(piece: &str) -> String {
    let start = piece.find("://").map(|i| i + 3).unwrap_or(0);
    let rest = &piece[start..];
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..end];
    let Some(at) = authority.rfind('@') else {
        return piece.to_string();
    };
    let userinfo = &authority[..at];
    // Not a URL (`"see me at noon @ home"`): whitespace cannot be in an authority.
    if userinfo.is_empty() || userinfo.contains(char::is_whitespace) {
        return piece.to_string();
    }
    // Leading whitespace of a list element (`a, nats://...`) stays.
    let lead = userinfo.len() - userinfo.trim_start().len();
    let (ws, userinfo) = userinfo.split_at(lead);
    let masked = match userinfo.split_once(':') {
        Some((user, _password)) => format!("{user}:{MASK}"),
        None => MASK.to_string(),
    };
    format!(
        "{}{ws}{masked}{}",
        &piece[..start],
        &piece[start + at..] // '@' and everything after it
    )
}

/// Masks the values of credential-like query parameters anywhere in `s`.
/// A value ends at `&`, `#` or whitespace (not at a comma, so nothing of a
/// value leaks through list splitting: over-masking is the safe side).
fn redact_query(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find(['?', '&']) {
        out.push_str(&rest[..=i]);
        rest = &rest[i + 1..];
        let key_end = rest
            .find(|c: char| c == '=' || c == '&' || c == '#' || c.is_whitespace())
            .unwrap_or(rest.len());
        let key = &rest[..key_end];
        if !rest[key_end..].starts_with('=') || !sensitive_key(key) {
            continue;
        }
        out.push_str(key);
        out.push('=');
        rest = &rest[key_end + 1..];
        let value_end = rest
            .find(|c: char| c == '&' || c == '#' || c.is_whitespace())
            .unwrap_or(rest.len());
        if value_end > 0 {
            out.push_str(MASK);
        }
        rest = &rest[value_end..];
    }
    out.push_str(rest);
    out
}

/// Whether a query parameter name looks like it carries a credential.
fn sensitive_key(key: &str) -> bool {
    let k: String = key
        .chars()
        .filter(|c| *c != '_' && *c != '-' && *c != '.')
        .flat_map(char::to_lowercase)
        .collect();
    const EXACT: &[&str] = &[
        "key", "sig", "pwd", "pass", "auth", "jwt", "nkey", "seed", "code",
    ];
    const PARTS: &[&str] = &[
        "token",
        "secret",
        "password",
        "passwd",
        "apikey",
        "accesskey",
        "privatekey",
        "signature",
        "credential",
        "authorization",
        "sessionid",
    ];
    EXACT.contains(&k.as_str()) || PARTS.iter().any(|p| k.contains(p))
}

/// A credential (API key, token, password) that never prints: `Debug` and
/// `Display` show `***`. [`Secret::expose`] is the one way to the value, so
/// every use of it is greppable. Deserializes from a plain string; it does
/// not serialize.
#[derive(Clone, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }

    /// The credential itself, for the one place that sends it.
    pub fn expose(&self) -> &str {
        &self.0
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(MASK)
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(MASK)
    }
}

impl From<String> for Secret {
    fn from(s: String) -> Self {
        Secret(s)
    }
}

impl From<&str> for Secret {
    fn from(s: &str) -> Self {
        Secret(s.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn userinfo_password_and_token() {
        assert_eq!(
            redact_url("nats://user:pass@host:4222"),
            "nats://user:***@host:4222"
        );
        assert_eq!(
            redact_url("nats://s3cr3t-token@host:4222"),
            "nats://***@host:4222"
        );
        assert_eq!(
            redact_url("https://me:pw@example.com/v1/chat"),
            "https://me:***@example.com/v1/chat"
        );
        assert_eq!(redact_url("tls://:onlypass@h:4222"), "tls://:***@h:4222");
        // A password with '@' in it: the last '@' of the authority ends the userinfo.
        assert_eq!(redact_url("nats://u:p@ss@h:4222"), "nats://u:***@h:4222");
        // No scheme.
        assert_eq!(redact_url("user:pass@host:4222"), "user:***@host:4222");
        // '@' after the authority is a path, not a userinfo.
        assert_eq!(
            redact_url("https://example.com/users/@me"),
            "https://example.com/users/@me"
        );
    }

    #[test]
    fn lists_are_redacted_element_by_element() {
        assert_eq!(
            redact_url("nats://a:b@h1:4222,nats://tok@h2:4222, nats://c:d@h3:4222"),
            "nats://a:***@h1:4222,nats://***@h2:4222, nats://c:***@h3:4222"
        );
        assert_eq!(
            redact_url("nats://127.0.0.1:4222,nats://[::1]:4223"),
            "nats://127.0.0.1:4222,nats://[::1]:4223"
        );
    }

    #[test]
    fn credential_query_parameters() {
        assert_eq!(
            redact_url("https://api.example.com/v1?api_key=abc123&model=x"),
            "https://api.example.com/v1?api_key=***&model=x"
        );
        assert_eq!(
            redact_url("https://h/p?x=1&token=abc#frag"),
            "https://h/p?x=1&token=***#frag"
        );
        assert_eq!(
            redact_url("https://h/p?Access-Token=abc&X-Api-Key=k&sig=s&page=2"),
            "https://h/p?Access-Token=***&X-Api-Key=***&sig=***&page=2"
        );
        assert_eq!(
            redact_url("https://u:p@h/p?password=pw"),
            "https://u:***@h/p?password=***"
        );
        // A comma inside a secret value does not let its tail through.
        assert_eq!(redact_url("https://h/?token=ab,cd"), "https://h/?token=***");
        // Empty values and harmless keys stay as they are.
        assert_eq!(redact_url("https://h/?token=&q=a"), "https://h/?token=&q=a");
        assert_eq!(
            redact_url("https://h/search?q=keyboard&monkey=1"),
            "https://h/search?q=keyboard&monkey=1"
        );
    }

    #[test]
    fn non_urls_are_unchanged() {
        for s in [
            "",
            "nats://127.0.0.1:4222",
            "http://127.0.0.1:8089/v1",
            "meet me @ noon",
            "plain text, with commas",
        ] {
            assert_eq!(redact_url(s), s);
        }
    }

    #[test]
    fn text_is_redacted_word_by_word() {
        assert_eq!(
            redact_text(
                r#"NATS_URL "nats://u:pw@h:4222,nats://tok@h2": invalid port; mail me@example.com"#
            ),
            r#"NATS_URL "nats://u:***@h:4222,nats://***@h2": invalid port; mail ***@example.com"#
        );
        assert_eq!(
            redact_text("GET https://h/v1?api_key=k1 failed (https://a:b@c/)"),
            "GET https://h/v1?api_key=*** failed (https://a:***@c/)"
        );
        assert_eq!(redact_text("nothing to see here"), "nothing to see here");
    }

    #[test]
    fn secret_never_prints() {
        let s = Secret::new("sk-live-123");
        assert_eq!(format!("{s}"), "***");
        assert_eq!(format!("{s:?}"), "***");
        assert_eq!(format!("{:?}", Some(s.clone())), "Some(***)");
        assert_eq!(s.expose(), "sk-live-123");
        let parsed: Secret = serde_json::from_str("\"k\"").expect("a string");
        assert_eq!(parsed.expose(), "k");
    }
}
