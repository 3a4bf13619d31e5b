//! Job-level retry: capped exponential backoff with full jitter.
//!
//! [`RetryPolicy`] is the job's: how many attempts, and the delay before
//! the next one, drawn by [`full_jitter`] under [`capped_exponential`]'s
//! ceiling. The backoff maths itself lives in `leasehold-time` (the model
//! client shares it without knowing the job protocol) and is re-exported
//! here, with [`Backoff`], the pauses of an operation tried again in place.

use std::time::Duration;

use rand::Rng;

pub use leasehold_time::backoff::{capped_exponential, full_jitter, Backoff};

use crate::JobSpec;

/// Job-level retry policy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryPolicy {
    /// Attempts in all (the first included) before the job fails.
    pub max_attempts: u32,
    pub base: Duration,
    pub cap: Duration,
}

/// `5 attempts, backoff 1s..5m` (human durations).
impl std::fmt::Display for RetryPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} attempts, backoff {}..{}",
            self.max_attempts,
            crate::time::human_duration(self.base),
            crate::time::human_duration(self.cap)
        )
    }
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 5,
            base: Duration::from_secs(1),
            cap: Duration::from_secs(300),
        }
    }
}

impl RetryPolicy {
    /// This policy with the spec's overrides applied.
    pub fn for_spec(self, spec: Option<&JobSpec>) -> Self {
        let Some(r) = spec.and_then(|s| s.retry.as_ref()) else {
            return self;
        };
        RetryPolicy {
            max_attempts: r.max_attempts.unwrap_or(self.max_attempts),
            base: r.base_ms.map(Duration::from_millis).unwrap_or(self.base),
            cap: r.cap_ms.map(Duration::from_millis).unwrap_or(self.cap),
        }
    }

    /// The capped exponential ceiling of retry number `attempt` (0-based).
    pub fn ceiling(&self, attempt: u32) -> Duration {
        capped_exponential(self.base, self.cap, attempt)
    }

    /// A full-jitter delay for retry number `attempt`.
    pub fn delay(&self, attempt: u32, rng: &mut impl Rng) -> Duration {
        full_jitter(self.ceiling(attempt), rng)
    }

    /// Whether a job that has failed `failed_attempts` times (this one
    /// included) may run again.
    pub fn allows_another(&self, failed_attempts: u32) -> bool {
        failed_attempts < self.max_attempts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ceiling_doubles_then_caps_and_jitter_stays_below() {
        let p = RetryPolicy {
            max_attempts: 5,
            base: Duration::from_millis(100),
            cap: Duration::from_millis(500),
        };
        let c: Vec<u128> = (0..5).map(|i| p.ceiling(i).as_millis()).collect();
        assert_eq!(c, vec![100, 200, 400, 500, 500]);
        let mut rng = rand::thread_rng();
        for i in 0..50 {
            assert!(p.delay(i % 6, &mut rng) <= p.ceiling(i % 6));
        }
        assert!(p.allows_another(4) && !p.allows_another(5));
    }

    #[test]
    fn large_attempts_stay_at_the_cap_without_overflow() {
        let p = RetryPolicy {
            max_attempts: u32::MAX,
            base: Duration::from_secs(1),
            cap: Duration::from_secs(300),
        };
        for attempt in [9, 31, 32, 63, 64, 1_000, u32::MAX] {
            assert_eq!(p.ceiling(attempt), p.cap, "attempt {attempt}");
        }
    }
}
