//! Job-level retry: capped exponential backoff with full jitter.
//!
//! The ceiling of attempt `n` (0-based) is `min(cap, base * 2^n)`, computed
//! with the `backoff` crate; the delay is uniform in `[0, ceiling]` (full
//! jitter), so a fleet retrying a shared failure spreads out.

use std::time::Duration;

use backoff::backoff::Backoff;
use rand::Rng;

use crate::JobSpec;

/// Job-level retry policy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryPolicy {
    /// Attempts in all (the first included) before the job fails.
    pub max_attempts: u32,
    pub base: Duration,
    pub cap: Duration,
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
        let mut b = backoff::ExponentialBackoffBuilder::new()
            .with_initial_interval(self.base)
            .with_multiplier(2.0)
            .with_randomization_factor(0.0)
            .with_max_interval(self.cap)
            .with_max_elapsed_time(None)
            .build();
        let mut d = self.base;
        for _ in 0..=attempt.min(64) {
            d = b.next_backoff().unwrap_or(self.cap);
        }
        d.min(self.cap)
    }

    /// A full-jitter delay for retry number `attempt`.
    pub fn delay(&self, attempt: u32, rng: &mut impl Rng) -> Duration {
        let ceil = self.ceiling(attempt);
        if ceil.is_zero() {
            return ceil;
        }
        Duration::from_micros(rng.gen_range(0..=ceil.as_micros() as u64))
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
}
