//! A circuit breaker per dependency (the model endpoint; later each tool).
//!
//! Transition table:
//!
//! | state | event | next |
//! |---|---|---|
//! | closed | failure rate over the window ≥ threshold (with ≥ `min_calls`) | open until now + cool-down |
//! | open | a call before the cool-down ends | open; fast failure, retry-after = time left |
//! | open | a call after the cool-down | half-open; this call is the probe |
//! | half-open | another call while the probe runs | fast failure |
//! | half-open | probe succeeds | closed, window cleared |
//! | half-open | probe fails | open again |
//!
//! A failure counts once per distinct request in the window
//! ([`CircuitBreaker::record_failure`] with the request's digest): one
//! request that always fails (a prompt the provider cannot serve) retried
//! many times is not a storm and never opens the breaker for every other
//! request; failures of many distinct requests are.
//!
//! Time is tokio's, so tests run it on a paused clock.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::time::Instant;

/// Breaker tuning.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BreakerConfig {
    /// How far back outcomes count.
    pub window: Duration,
    /// Fewer calls than this in the window never open the breaker.
    pub min_calls: usize,
    /// Failure fraction (0..=1) that opens it.
    pub failure_rate: f64,
    /// How long it stays open before a probe.
    pub cool_down: Duration,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig {
            window: Duration::from_secs(60),
            min_calls: 10,
            failure_rate: 0.5,
            cool_down: Duration::from_secs(15),
        }
    }
}

/// The observable state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BreakerState {
    Closed,
    Open,
    HalfOpen,
}

#[derive(Debug)]
enum Inner {
    Closed,
    Open { until: Instant },
    HalfOpen { probe_in_flight: bool },
}

/// One call in the window: when, whether it succeeded, the request's digest.
type Outcome = (Instant, bool, Option<u64>);

/// One dependency's breaker. Shared by reference (`Arc`) between attempts.
#[derive(Debug)]
pub struct CircuitBreaker {
    name: String,
    cfg: BreakerConfig,
    state: Mutex<(Inner, VecDeque<Outcome>)>,
    /// The last failure counted: the cause an open breaker reports.
    cause: Mutex<String>,
}

impl CircuitBreaker {
    pub fn new(name: impl Into<String>, cfg: BreakerConfig) -> Self {
        CircuitBreaker {
            name: name.into(),
            cfg,
            state: Mutex::new((Inner::Closed, VecDeque::new())),
            cause: Mutex::new(String::new()),
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// How long it stays open once opened.
    pub fn cool_down(&self) -> Duration {
        self.cfg.cool_down
    }

    pub fn state(&self) -> BreakerState {
        match self.state.lock().expect("breaker lock").0 {
            Inner::Closed => BreakerState::Closed,
            Inner::Open { .. } => BreakerState::Open,
            Inner::HalfOpen { .. } => BreakerState::HalfOpen,
        }
    }

    /// Asks to make a call. `Err(retry_after)` is a fast failure.
    pub fn try_acquire(&self) -> Result<(), Duration> {
        let mut g = self.state.lock().expect("breaker lock");
        let now = Instant::now();
        match g.0 {
            Inner::Closed => Ok(()),
            Inner::Open { until } if now < until => Err(until - now),
            Inner::Open { .. } => {
                g.0 = Inner::HalfOpen {
                    probe_in_flight: true,
                };
                Ok(())
            }
            Inner::HalfOpen {
                probe_in_flight: true,
            } => Err(self.cfg.cool_down),
            Inner::HalfOpen {
                probe_in_flight: false,
            } => {
                g.0 = Inner::HalfOpen {
                    probe_in_flight: true,
                };
                Ok(())
            }
        }
    }

    /// The failure that opened the breaker (or the last one counted).
    pub fn cause(&self) -> String {
        self.cause.lock().expect("breaker cause").clone()
    }

    /// Records a failed call of the request with digest `key`: counted
    /// unless that request already failed within the window.
    pub fn record_failure(&self, key: u64, cause: &str) {
        let dup = {
            let g = self.state.lock().expect("breaker lock");
            matches!(g.0, Inner::Closed) && g.1.iter().any(|(_, ok, k)| !ok && *k == Some(key))
        };
        if dup {
            return;
        }
        *self.cause.lock().expect("breaker cause") = cause.to_string();
        self.record_entry(false, Some(key));
    }

    /// Records the outcome of a call that `try_acquire` allowed.
    pub fn record(&self, success: bool) {
        self.record_entry(success, None)
    }

    fn record_entry(&self, success: bool, key: Option<u64>) {
        let mut g = self.state.lock().expect("breaker lock");
        let now = Instant::now();
        match g.0 {
            Inner::HalfOpen { .. } => {
                if success {
                    g.0 = Inner::Closed;
                    g.1.clear();
                } else {
                    g.0 = Inner::Open {
                        until: now + self.cfg.cool_down,
                    };
                }
            }
            Inner::Open { .. } => {}
            Inner::Closed => {
                g.1.push_back((now, success, key));
                let window = self.cfg.window;
                while g
                    .1
                    .front()
                    .is_some_and(|(t, _, _)| now.duration_since(*t) > window)
                {
                    g.1.pop_front();
                }
                let total = g.1.len();
                let failures = g.1.iter().filter(|(_, ok, _)| !ok).count();
                if total >= self.cfg.min_calls
                    && failures as f64 >= self.cfg.failure_rate * total as f64
                {
                    tracing::warn!(dependency = %self.name, failures, total, "circuit breaker opens");
                    g.0 = Inner::Open {
                        until: now + self.cfg.cool_down,
                    };
                    g.1.clear();
                }
            }
        }
    }
}

impl CircuitBreaker {
    /// Gives back a probe slot without an outcome (the call was cancelled).
    pub fn release(&self) {
        let mut g = self.state.lock().expect("breaker lock");
        if let Inner::HalfOpen {
            probe_in_flight: true,
        } = g.0
        {
            g.0 = Inner::HalfOpen {
                probe_in_flight: false,
            };
        }
    }
}
