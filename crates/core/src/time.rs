//! Timestamps (RFC 3339 UTC, millisecond precision) and human durations.

use std::time::{Duration, SystemTime};

/// `2026-11-30T10:11:55.123Z`.
pub fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_millis(t).to_string()
}

/// Parses an RFC 3339 timestamp written by [`rfc3339`] (or any RFC 3339 UTC time).
pub fn parse_rfc3339(s: &str) -> Option<SystemTime> {
    humantime::parse_rfc3339_weak(s).ok()
}

/// Parses `500ms`, `3s`, `2m`, `1h 30m`; a bare number is seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    if let Ok(secs) = s.parse::<u64>() {
        return Ok(Duration::from_secs(secs));
    }
    humantime::parse_duration(s)
        .map_err(|e| format!("invalid duration {s:?} ({e}); write it like 500ms, 3s or 2m"))
}

/// Formats a duration the way [`parse_duration`] reads it.
pub fn format_duration(d: Duration) -> String {
    humantime::format_duration(d).to_string()
}

/// How long from `now` until `at` (zero when `at` is past or unparsable).
pub fn until(now: SystemTime, at: Option<&str>) -> Duration {
    at.and_then(parse_rfc3339)
        .and_then(|t| t.duration_since(now).ok())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_like_the_docs_say() {
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("3s").unwrap(), Duration::from_secs(3));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_duration("7").unwrap(), Duration::from_secs(7));
        assert!(parse_duration("soon").unwrap_err().contains("500ms"));
    }

    #[test]
    fn timestamps_round_trip() {
        let t = SystemTime::UNIX_EPOCH + Duration::from_millis(1_700_000_000_123);
        let s = rfc3339(t);
        assert!(s.ends_with('Z'));
        assert_eq!(parse_rfc3339(&s), Some(t));
        assert_eq!(
            until(t, Some(&rfc3339(t + Duration::from_secs(2)))),
            Duration::from_secs(2)
        );
        assert_eq!(until(t, Some(&s)), Duration::ZERO);
    }
}
