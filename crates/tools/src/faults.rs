//! Fault injection inside the tool layer, for tests, the demo and the chaos
//! suite.
//!
//! `faults.fail_next(n, mode)` makes the next `n` executions (optionally of
//! one tool only) misbehave. The faults wrap the tool's own execution, so the
//! ledger, reconciliation and retry logic around it run for real:
//!
//! | mode | what happens |
//! |---|---|
//! | `timeout_after_commit` | the tool runs (the effect happens), then the caller gets a timeout |
//! | `timeout_before_commit` | the caller gets a timeout; the tool never ran |
//! | `error_5xx` | the caller gets HTTP 503; the tool never ran |
//! | `empty_success` | the tool runs, then its answer is replaced by an empty success |
//! | `slow` | the tool runs after a delay (see [`Faults::set_slow_delay`]), inside the tool's timeout |
//!
//! `LH_TOOL_FAULTS` configures the same at start-up:
//! `publish:timeout_after_commit:1,search:error_5xx:2` (`*` = any tool).

use std::collections::VecDeque;
use std::str::FromStr;
use std::sync::Mutex;
use std::time::Duration;

/// One kind of injected fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultMode {
    TimeoutAfterCommit,
    TimeoutBeforeCommit,
    Error5xx,
    EmptySuccess,
    Slow,
}

impl FromStr for FaultMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "timeout_after_commit" => FaultMode::TimeoutAfterCommit,
            "timeout_before_commit" => FaultMode::TimeoutBeforeCommit,
            "error_5xx" => FaultMode::Error5xx,
            "empty_success" => FaultMode::EmptySuccess,
            "slow" => FaultMode::Slow,
            other => {
                return Err(format!(
                    "unknown fault mode `{other}` (timeout_after_commit, timeout_before_commit, error_5xx, empty_success, slow)"
                ))
            }
        })
    }
}

#[derive(Debug, Clone)]
struct Armed {
    tool: Option<String>,
    mode: FaultMode,
    remaining: u32,
}

/// The armed faults of one toolbox. Shared by all its calls.
#[derive(Debug)]
pub struct Faults {
    armed: Mutex<VecDeque<Armed>>,
    slow_delay: Mutex<Duration>,
}

impl Default for Faults {
    fn default() -> Self {
        Faults {
            armed: Mutex::new(VecDeque::new()),
            slow_delay: Mutex::new(Duration::from_secs(2)),
        }
    }
}

impl Faults {
    /// The next `n` executions of any tool fail with `mode`.
    pub fn fail_next(&self, n: u32, mode: FaultMode) {
        self.push(None, n, mode);
    }

    /// The next `n` executions of `tool` fail with `mode`.
    pub fn fail_next_for(&self, tool: &str, n: u32, mode: FaultMode) {
        self.push(Some(tool.to_string()), n, mode);
    }

    /// How long `slow` delays an execution (default 2 s).
    pub fn set_slow_delay(&self, d: Duration) {
        *self.slow_delay.lock().expect("faults lock") = d;
    }

    pub(crate) fn slow_delay(&self) -> Duration {
        *self.slow_delay.lock().expect("faults lock")
    }

    /// Disarms everything.
    pub fn clear(&self) {
        self.armed.lock().expect("faults lock").clear();
    }

    fn push(&self, tool: Option<String>, n: u32, mode: FaultMode) {
        if n > 0 {
            self.armed.lock().expect("faults lock").push_back(Armed {
                tool,
                mode,
                remaining: n,
            });
        }
    }

    /// Takes one armed fault for an execution of `tool`, if any.
    pub(crate) fn take(&self, tool: &str) -> Option<FaultMode> {
        let mut armed = self.armed.lock().expect("faults lock");
        let idx = armed
            .iter()
            .position(|a| a.tool.as_deref().is_none_or(|t| t == tool))?;
        let a = &mut armed[idx];
        let mode = a.mode;
        a.remaining -= 1;
        if a.remaining == 0 {
            armed.remove(idx);
        }
        Some(mode)
    }

    /// Parses `LH_TOOL_FAULTS` syntax: `tool:mode:n,...` (`*` for any tool).
    pub fn parse_into(&self, spec: &str) -> Result<(), String> {
        for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let fields: Vec<&str> = part.split(':').collect();
            let (tool, mode, n) = match fields.as_slice() {
                [tool, mode] => (*tool, *mode, 1),
                [tool, mode, n] => (
                    *tool,
                    *mode,
                    n.parse::<u32>()
                        .map_err(|_| format!("bad count in fault `{part}`"))?,
                ),
                _ => return Err(format!("bad fault `{part}`: want tool:mode[:count]")),
            };
            let mode = FaultMode::from_str(mode)?;
            let tool = (tool != "*").then(|| tool.to_string());
            self.push(tool, n, mode);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_are_taken_in_order_and_per_tool() {
        let f = Faults::default();
        f.parse_into("publish:timeout_after_commit:2, *:error_5xx")
            .unwrap();
        assert_eq!(f.take("search"), Some(FaultMode::Error5xx));
        assert_eq!(f.take("search"), None);
        assert_eq!(f.take("publish"), Some(FaultMode::TimeoutAfterCommit));
        assert_eq!(f.take("publish"), Some(FaultMode::TimeoutAfterCommit));
        assert_eq!(f.take("publish"), None);
        assert!(f.parse_into("x:bogus").is_err());
    }
}
