//! Time for every leasehold crate, pure and without a clock of its own:
//! timestamps (RFC 3339 UTC, millisecond precision), human durations, and
//! the backoff maths every retry loop shares ([`backoff`]).
//!
//! Every duration the project reads, from a flag or an environment variable
//! of any binary, goes through [`parse_duration`], so one syntax holds
//! everywhere: a number followed by a unit (`500ms`, `3s`, `2m`, `1h 30m`,
//! `7d`). A bare number is refused (except `0`): `LH_MODEL_IDLE_TIMEOUT=30`
//! could mean seconds or milliseconds, and guessing wrong by a factor of a
//! thousand is worse than asking for the unit at start.
//!
//! A crate of its own so that the model client and the job protocol share
//! it without the client knowing the protocol (`leasehold-core` re-exports
//! it as `leasehold_core::time`).

pub mod backoff;

use std::time::{Duration, SystemTime};

/// `2026-11-30T10:11:55.123Z`.
pub fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_millis(t).to_string()
}

/// Parses an RFC 3339 timestamp written by [`rfc3339`] (or any RFC 3339 UTC time).
pub fn parse_rfc3339(s: &str) -> Option<SystemTime> {
    humantime::parse_rfc3339_weak(s).ok()
}

/// Parses `500ms`, `3s`, `2m`, `1h 30m`; a bare number other than `0` is an
/// error that says which unit to add.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    if s.chars().all(|c| c.is_ascii_digit()) && !s.is_empty() {
        if s.bytes().all(|b| b == b'0') {
            return Ok(Duration::ZERO);
        }
        return Err(format!(
            "invalid duration {s:?}: a bare number has no unit; write {s}s, {s}ms or {s}m"
        ));
    }
    humantime::parse_duration(s)
        .map_err(|e| format!("invalid duration {s:?} ({e}); write it like 500ms, 3s or 2m"))
}

/// Reads the duration in variable `name` through `get` (the environment, or a
/// map in tests): `Ok(None)` when unset or blank, an error naming the
/// variable when the value does not parse.
pub fn env_duration(
    get: &dyn Fn(&str) -> Option<String>,
    name: &str,
) -> Result<Option<Duration>, String> {
    match get(name).filter(|v| !v.trim().is_empty()) {
        None => Ok(None),
        Some(v) => parse_duration(&v)
            .map(Some)
            .map_err(|e| format!("{name}: {e}")),
    }
}

/// Formats a duration the way [`parse_duration`] reads it.
pub fn format_duration(d: Duration) -> String {
    humantime::format_duration(d).to_string()
}

/// A duration for people to read, rounded to what matters at its size:
/// `850ms`, `3.2s`, `4m 12s`, `6h`, `2h 30m`, `7d`, `1d 6h`. Logs and the
/// CLI's lines use it instead of `Debug` (`21600s`, `1.234567s`).
pub fn human_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms < 1_000 {
        return format!("{ms}ms");
    }
    if ms < 10_000 {
        // One decimal below ten seconds: 3.2s.
        let tenths = (ms + 50) / 100;
        return if tenths.is_multiple_of(10) {
            format!("{}s", tenths / 10)
        } else {
            format!("{}.{}s", tenths / 10, tenths % 10)
        };
    }
    let s = (ms + 500) / 1_000;
    let pair = |big: u128, big_unit: &str, small: u128, small_unit: &str| {
        if small == 0 {
            format!("{big}{big_unit}")
        } else {
            format!("{big}{big_unit} {small}{small_unit}")
        }
    };
    match s {
        0..=59 => format!("{s}s"),
        60..=3_599 => pair(s / 60, "m", s % 60, "s"),
        3_600..=86_399 => pair(s / 3_600, "h", (s % 3_600) / 60, "m"),
        _ => pair(s / 86_400, "d", (s % 86_400) / 3_600, "h"),
    }
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
    fn human_durations_round_to_what_matters() {
        let ms = Duration::from_millis;
        assert_eq!(human_duration(ms(0)), "0ms");
        assert_eq!(human_duration(ms(850)), "850ms");
        assert_eq!(human_duration(ms(3_240)), "3.2s");
        assert_eq!(human_duration(ms(2_000)), "2s");
        assert_eq!(human_duration(ms(9_990)), "10s");
        assert_eq!(human_duration(ms(42_400)), "42s");
        assert_eq!(human_duration(Duration::from_secs(252)), "4m 12s");
        assert_eq!(human_duration(Duration::from_secs(300)), "5m");
        assert_eq!(human_duration(Duration::from_secs(21_600)), "6h");
        assert_eq!(human_duration(Duration::from_secs(9_000)), "2h 30m");
        assert_eq!(human_duration(Duration::from_secs(7 * 86_400)), "7d");
        assert_eq!(human_duration(Duration::from_secs(30 * 3_600)), "1d 6h");
    }

    #[test]
    fn durations_read_like_the_docs_say() {
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("3s").unwrap(), Duration::from_secs(3));
        assert_eq!(parse_duration(" 2m ").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_duration("1h 30m").unwrap(), Duration::from_secs(5400));
        assert_eq!(
            parse_duration("7d").unwrap(),
            Duration::from_secs(7 * 86_400)
        );
        assert!(parse_duration("soon").unwrap_err().contains("500ms"));
        assert!(parse_duration("").is_err());
        assert!(parse_duration("-3s").is_err());
    }

    #[test]
    fn a_bare_number_needs_a_unit_except_zero() {
        let e = parse_duration("30").unwrap_err();
        assert!(e.contains("no unit") && e.contains("30s"), "{e}");
        assert_eq!(parse_duration("0").unwrap(), Duration::ZERO);
        assert_eq!(parse_duration("000").unwrap(), Duration::ZERO);
        assert_eq!(parse_duration("0s").unwrap(), Duration::ZERO);
    }

    #[test]
    fn env_durations_name_the_variable() {
        let get = |k: &str| match k {
            "GOOD" => Some("250ms".to_string()),
            "BLANK" => Some("  ".to_string()),
            "BARE" => Some("30".to_string()),
            _ => None,
        };
        assert_eq!(
            env_duration(&get, "GOOD").unwrap(),
            Some(Duration::from_millis(250))
        );
        assert_eq!(env_duration(&get, "BLANK").unwrap(), None);
        assert_eq!(env_duration(&get, "UNSET").unwrap(), None);
        let e = env_duration(&get, "BARE").unwrap_err();
        assert!(e.starts_with("BARE: ") && e.contains("30s"), "{e}");
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
