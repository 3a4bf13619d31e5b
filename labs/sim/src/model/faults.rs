//! Fault rules of the simulated model (format in the parent module's docs).

use std::path::Path;
use std::sync::Mutex;

use anyhow::Context;
use serde::Deserialize;

/// The faults the simulator can serve.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultKind {
    Cut,
    Empty,
    ErrorEvent,
    RateLimit,
    Quota,
    ServerError,
    Overloaded,
    Hang,
    Slow,
    MalformedArgs,
    ContextExceeded,
    Refusal,
    Html,
    NotFound,
    Unauthorized,
    #[serde(rename = "invalid_request_500")]
    InvalidRequest500,
}

impl FaultKind {
    pub fn parse(s: &str) -> Option<FaultKind> {
        Some(
            match s.trim().to_ascii_lowercase().replace('-', "_").as_str() {
                "cut" => FaultKind::Cut,
                "empty" => FaultKind::Empty,
                "error_event" | "error" => FaultKind::ErrorEvent,
                "rate_limit" | "429" => FaultKind::RateLimit,
                "quota" => FaultKind::Quota,
                "server_error" | "500" => FaultKind::ServerError,
                "overloaded" | "503" => FaultKind::Overloaded,
                "hang" => FaultKind::Hang,
                "slow" => FaultKind::Slow,
                "malformed_args" => FaultKind::MalformedArgs,
                "context_exceeded" | "context" => FaultKind::ContextExceeded,
                "refusal" => FaultKind::Refusal,
                "html" => FaultKind::Html,
                "not_found" | "404" => FaultKind::NotFound,
                "unauthorized" | "401" => FaultKind::Unauthorized,
                "invalid_request_500" => FaultKind::InvalidRequest500,
                _ => return None,
            },
        )
    }

    pub fn name(self) -> &'static str {
        match self {
            FaultKind::Cut => "cut",
            FaultKind::Empty => "empty",
            FaultKind::ErrorEvent => "error_event",
            FaultKind::RateLimit => "rate_limit",
            FaultKind::Quota => "quota",
            FaultKind::ServerError => "server_error",
            FaultKind::Overloaded => "overloaded",
            FaultKind::Hang => "hang",
            FaultKind::Slow => "slow",
            FaultKind::MalformedArgs => "malformed_args",
            FaultKind::ContextExceeded => "context_exceeded",
            FaultKind::Refusal => "refusal",
            FaultKind::Html => "html",
            FaultKind::NotFound => "not_found",
            FaultKind::Unauthorized => "unauthorized",
            FaultKind::InvalidRequest500 => "invalid_request_500",
        }
    }
}

/// Parameters of a fired fault.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Params {
    pub retry_after: Option<String>,
    pub delay_ms: Option<u64>,
}

#[derive(Debug, Clone, Deserialize)]
struct Rule {
    kind: FaultKind,
    #[serde(default)]
    nth: Vec<u64>,
    every: Option<u64>,
    rate: Option<f64>,
    after: Option<u64>,
    times: Option<u64>,
    #[serde(rename = "match")]
    matches: Option<String>,
    above_chars: Option<usize>,
    #[serde(flatten)]
    params: Params,
}

#[derive(Debug, Default, Deserialize)]
struct File {
    #[serde(default)]
    rules: Vec<Rule>,
}

/// Loaded rules, the env rate, and how often each rule fired.
pub struct Faults {
    seed: u64,
    rules: Vec<Rule>,
    fired: Mutex<Vec<u64>>,
    env_rate: f64,
    env_kinds: Vec<FaultKind>,
}

impl Faults {
    pub fn load(path: Option<&Path>, seed: u64) -> anyhow::Result<Faults> {
        let file: File = match path {
            Some(p) => {
                let text = std::fs::read_to_string(p)
                    .with_context(|| format!("reading fault file {}", p.display()))?;
                serde_json::from_str(&text)
                    .with_context(|| format!("parsing fault file {}", p.display()))?
            }
            None => File::default(),
        };
        let env_rate = match std::env::var("LH_SIM_FAULT_RATE") {
            Ok(v) if !v.is_empty() => v
                .parse::<f64>()
                .with_context(|| format!("LH_SIM_FAULT_RATE={v}"))?
                .clamp(0.0, 1.0),
            _ => 0.0,
        };
        let env_kinds = match std::env::var("LH_SIM_FAULT_KINDS") {
            Ok(v) if !v.trim().is_empty() => v
                .split(',')
                .map(|k| {
                    FaultKind::parse(k)
                        .with_context(|| format!("unknown fault kind {k:?} in LH_SIM_FAULT_KINDS"))
                })
                .collect::<anyhow::Result<Vec<_>>>()?,
            _ => vec![
                FaultKind::Cut,
                FaultKind::Empty,
                FaultKind::ErrorEvent,
                FaultKind::RateLimit,
                FaultKind::Overloaded,
            ],
        };
        Ok(Faults {
            seed,
            fired: Mutex::new(vec![0; file.rules.len()]),
            rules: file.rules,
            env_rate,
            env_kinds,
        })
    }

    /// The fault for request number `n` (1-based), if any.
    pub fn pick(&self, n: u64, last_user: &str, chars: usize) -> Option<(FaultKind, Params)> {
        let mut fired = self.fired.lock().expect("faults lock");
        for (i, r) in self.rules.iter().enumerate() {
            if r.times.is_some_and(|t| fired[i] >= t) || r.after.is_some_and(|a| n < a) {
                continue;
            }
            if r.matches.as_deref().is_some_and(|m| !last_user.contains(m)) {
                continue;
            }
            if r.above_chars.is_some_and(|a| chars <= a) {
                continue;
            }
            let scheduled = !r.nth.is_empty() || r.every.is_some() || r.rate.is_some();
            let hit = !scheduled
                || r.nth.contains(&n)
                || r.every.is_some_and(|e| e > 0 && n.is_multiple_of(e))
                || r.rate.is_some_and(|p| unit(self.seed, n, i as u64) < p);
            if hit {
                fired[i] += 1;
                return Some((r.kind, r.params.clone()));
            }
        }
        if self.env_rate > 0.0
            && !self.env_kinds.is_empty()
            && unit(self.seed, n, u64::MAX) < self.env_rate
        {
            let k = self.env_kinds[(super::play::mix(self.seed ^ n.rotate_left(17))
                % self.env_kinds.len() as u64) as usize];
            return Some((k, Params::default()));
        }
        None
    }
}

/// A deterministic number in [0, 1) from the seed, request number and rule.
fn unit(seed: u64, n: u64, salt: u64) -> f64 {
    (super::play::mix(seed ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ salt.rotate_left(32)) >> 11)
        as f64
        / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn faults(rules: serde_json::Value) -> Faults {
        let file: File = serde_json::from_value(json_rules(rules)).unwrap();
        Faults {
            seed: 1,
            fired: Mutex::new(vec![0; file.rules.len()]),
            rules: file.rules,
            env_rate: 0.0,
            env_kinds: vec![],
        }
    }

    fn json_rules(rules: serde_json::Value) -> serde_json::Value {
        serde_json::json!({ "rules": rules })
    }

    fn kinds(f: &Faults, n: u64, user: &str, chars: usize) -> Option<FaultKind> {
        f.pick(n, user, chars).map(|(k, _)| k)
    }

    #[test]
    fn schedules_rates_and_conditions() {
        let f = faults(serde_json::json!([
            {"kind": "cut", "nth": [2]},
            {"kind": "rate_limit", "every": 3, "times": 1, "retry_after": "2"},
            {"kind": "refusal", "match": "forbidden"},
            {"kind": "context_exceeded", "above_chars": 100}
        ]));
        assert_eq!(kinds(&f, 1, "", 10), None);
        assert_eq!(kinds(&f, 2, "", 10), Some(FaultKind::Cut));
        let (k, p) = f.pick(3, "", 10).unwrap();
        assert_eq!(
            (k, p.retry_after.as_deref()),
            (FaultKind::RateLimit, Some("2"))
        );
        assert_eq!(kinds(&f, 6, "", 10), None, "times: 1");
        assert_eq!(
            kinds(&f, 7, "a forbidden topic", 10),
            Some(FaultKind::Refusal)
        );
        assert_eq!(kinds(&f, 8, "", 101), Some(FaultKind::ContextExceeded));
    }

    #[test]
    fn new_kinds_parse_from_files_and_headers() {
        let f = faults(serde_json::json!([
            {"kind": "html", "nth": [1]},
            {"kind": "not_found", "nth": [2]},
            {"kind": "unauthorized", "nth": [3]},
            {"kind": "invalid_request_500", "nth": [4]}
        ]));
        let got: Vec<_> = (1..=4).map(|n| kinds(&f, n, "", 0).unwrap()).collect();
        assert_eq!(
            got,
            [
                FaultKind::Html,
                FaultKind::NotFound,
                FaultKind::Unauthorized,
                FaultKind::InvalidRequest500
            ]
        );
        for k in got {
            assert_eq!(FaultKind::parse(k.name()), Some(k));
        }
    }

    #[test]
    fn rates_are_deterministic_and_roughly_right() {
        let a = faults(serde_json::json!([{"kind": "overloaded", "rate": 0.3}]));
        let b = faults(serde_json::json!([{"kind": "overloaded", "rate": 0.3}]));
        let hits: Vec<bool> = (1..=1000).map(|n| a.pick(n, "", 0).is_some()).collect();
        let again: Vec<bool> = (1..=1000).map(|n| b.pick(n, "", 0).is_some()).collect();
        assert_eq!(hits, again);
        let count = hits.iter().filter(|h| **h).count();
        assert!((200..400).contains(&count), "{count}");
    }
}
