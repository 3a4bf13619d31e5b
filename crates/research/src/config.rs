//! The workload's configuration: [`ResearchConfig`], read once at the
//! worker's start from the environment ([`ENV_VARS`] lists each variable),
//! every bad value refused with its variable's name.

use leasehold::runtime::{
    format_duration, BreakerConfig, GenerationPolicy, ModelConfig, Providers, SectionPolicy,
    ToolboxConfig,
};
use leasehold::Error;

use crate::hooks::CrashPoint;

/// Every variable of the workload itself that [`ResearchConfig::from_env`]
/// reads (the model's and the tools' are in `leasehold::runtime::MODEL_ENV_VARS`
/// and `leasehold::runtime::TOOL_ENV_VARS`), with what it means and its default.
pub const ENV_VARS: &[(&str, &str)] = &[
    (
        "LH_RESEARCH_EXPERT_CONCURRENCY",
        "experts written at once per job [default: 3]",
    ),
    (
        "LH_RESEARCH_RETRY_BASE",
        "first generation retry delay ceiling (doubles per retry, full jitter) [default: 500ms]",
    ),
    (
        "LH_RESEARCH_RETRY_CAP",
        "cap of the generation retry delay [default: 20s]",
    ),
    (
        "LH_RESEARCH_BREAKER_COOL_DOWN",
        "how long the model circuit breaker stays open [default: 15s]",
    ),
    (
        "LH_RESEARCH_BREAKER_MIN_CALLS",
        "calls before the breaker may open [default: 10]",
    ),
    (
        "LH_RESEARCH_CRASH_AT",
        "tests only, needs --dev-kinds: abort the worker at a checkpoint (after_phase:P, after_section:K, ...) [default: none]",
    ),
];

/// Configuration of the workload.
///
/// | field | default | env |
/// |---|---|---|
/// | `model` | see `ModelConfig` | `LH_MODEL_*` |
/// | `toolbox` | see `ToolboxConfig` | `LH_SEARCH_URL`, `LH_FETCH_ALLOW`, `LH_PUBLISH_URL`, ... |
/// | `expert_concurrency` | 3 | `LH_RESEARCH_EXPERT_CONCURRENCY` |
/// | `generation.base` / `.cap` | 500 ms / 20 s | `LH_RESEARCH_RETRY_BASE` / `LH_RESEARCH_RETRY_CAP` |
/// | `breaker.cool_down` / `.min_calls` | 15 s / 10 | `LH_RESEARCH_BREAKER_COOL_DOWN` / `LH_RESEARCH_BREAKER_MIN_CALLS` |
/// | `crash_at` | none | `LH_RESEARCH_CRASH_AT` (tests: `after_phase:outline`, `after_section:K`, `after_tool_result:K`, `after_model_response:K`, `mid_final:K`, `after_artifact`, `after_delivery`) |
///
/// Durations need a unit (`500ms`, `3s`, `2m`). The worker reads this once
/// at start and refuses to run when a value is bad, so no job fails later
/// for a configuration error.
#[derive(Debug, Clone)]
pub struct ResearchConfig {
    pub model: ModelConfig,
    pub toolbox: ToolboxConfig,
    pub expert_concurrency: usize,
    pub section_policy: SectionPolicy,
    pub generation: GenerationPolicy,
    pub breaker: BreakerConfig,
    pub crash_at: Option<CrashPoint>,
    /// What the worker's research jobs know of the model provider (a form
    /// learned from a refusal, an answer seen once): made with the
    /// configuration, so every job of a worker that was given it shares it.
    pub providers: std::sync::Arc<Providers>,
}

impl ResearchConfig {
    pub fn from_env() -> Result<Self, Error> {
        Self::from_lookup(&|k| std::env::var(k).ok())
    }

    /// Like [`ResearchConfig::from_env`] with an explicit variable source
    /// (tests). Every error names the variable.
    pub fn from_lookup(get: &dyn Fn(&str) -> Option<String>) -> Result<Self, Error> {
        let var = |k: &str| get(k).filter(|v| !v.trim().is_empty());
        let bad =
            |k: &str, v: &str, e: &dyn std::fmt::Display| Error::terminal(format!("{k}={v}: {e}"));
        let dur = |k: &str| leasehold::runtime::env_duration(get, k).map_err(Error::terminal);
        let mut generation = GenerationPolicy::default();
        if let Some(d) = dur("LH_RESEARCH_RETRY_BASE")? {
            generation.base = d;
        }
        if let Some(d) = dur("LH_RESEARCH_RETRY_CAP")? {
            generation.cap = d;
        }
        if generation.cap < generation.base {
            return Err(Error::terminal(format!(
                "LH_RESEARCH_RETRY_CAP ({}) is below LH_RESEARCH_RETRY_BASE ({})",
                format_duration(generation.cap),
                format_duration(generation.base)
            )));
        }
        let mut breaker = BreakerConfig::default();
        if let Some(d) = dur("LH_RESEARCH_BREAKER_COOL_DOWN")? {
            breaker.cool_down = d;
        }
        if let Some(v) = var("LH_RESEARCH_BREAKER_MIN_CALLS") {
            breaker.min_calls = v
                .trim()
                .parse()
                .map_err(|e| bad("LH_RESEARCH_BREAKER_MIN_CALLS", &v, &e))?;
        }
        let expert_concurrency = match var("LH_RESEARCH_EXPERT_CONCURRENCY") {
            Some(v) => v
                .trim()
                .parse::<usize>()
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| {
                    bad(
                        "LH_RESEARCH_EXPERT_CONCURRENCY",
                        &v,
                        &"expected a positive integer",
                    )
                })?,
            None => 3,
        };
        let crash_at = match var("LH_RESEARCH_CRASH_AT") {
            Some(v) => Some(
                CrashPoint::parse(v.trim())
                    .ok_or_else(|| bad("LH_RESEARCH_CRASH_AT", &v, &"unknown crash point"))?,
            ),
            None => None,
        };
        Ok(ResearchConfig {
            model: ModelConfig::from_lookup(get).map_err(|e| Error::terminal(e.to_string()))?,
            toolbox: ToolboxConfig::from_lookup(get).map_err(|e| Error::terminal(e.to_string()))?,
            expert_concurrency,
            section_policy: SectionPolicy::default(),
            generation,
            breaker,
            crash_at,
            providers: Default::default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex as StdMutex;

    #[test]
    fn every_variable_read_is_listed_for_help() {
        let read = StdMutex::new(Vec::new());
        ResearchConfig::from_lookup(&|k| {
            read.lock().unwrap().push(k.to_string());
            None
        })
        .unwrap();
        let listed: Vec<&str> = ENV_VARS
            .iter()
            .chain(leasehold::runtime::MODEL_ENV_VARS)
            .chain(leasehold::runtime::TOOL_ENV_VARS)
            .map(|(k, _)| *k)
            .collect();
        let read = read.into_inner().unwrap();
        assert!(read.len() > 10, "{read:?}");
        for k in read {
            assert!(listed.contains(&k.as_str()), "{k} is read but not listed");
        }
    }

    #[test]
    fn a_bad_value_names_its_variable() {
        for (k, v) in [
            ("LH_RESEARCH_RETRY_BASE", "500"),
            ("LH_RESEARCH_BREAKER_COOL_DOWN", "a while"),
            ("LH_RESEARCH_EXPERT_CONCURRENCY", "0"),
            ("LH_RESEARCH_CRASH_AT", "somewhere"),
            ("LH_MODEL_IDLE_TIMEOUT", "30"),
            ("LH_MODEL_BASE_URL", "localhost:8000/v1"),
            ("LH_PUBLISH_URL", "hooks"),
        ] {
            let e = ResearchConfig::from_lookup(&|q| (q == k).then(|| v.to_string())).unwrap_err();
            assert!(e.to_string().contains(k), "{k}={v}: {e}");
        }
        let e = ResearchConfig::from_lookup(&|q| match q {
            "LH_RESEARCH_RETRY_BASE" => Some("2s".into()),
            "LH_RESEARCH_RETRY_CAP" => Some("1s".into()),
            _ => None,
        })
        .unwrap_err();
        assert!(e.to_string().contains("LH_RESEARCH_RETRY_CAP"), "{e}");
    }
}
